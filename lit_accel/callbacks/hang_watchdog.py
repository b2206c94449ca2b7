"""``HangWatchdog``: Lightning's hooks mark the phases of :class:`~lit_accel.meters.ProgressWatchdog`, which watches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lit_accel.meters.progress_watchdog import HangReport, ProgressWatchdog
from lit_accel.utilities._compat import launched_child_processes
from lit_accel.utilities._idle_hooks import idle, idle_unused, wake
from lit_accel.utilities._validation import check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["REPORT_AFTER_S", "HangWatchdog", "add_hang_watchdog"]

REPORT_AFTER_S = 300.0  #: seconds without progress after which the strategies' default watchdog reports a stall


class HangWatchdog(Callback):
    """Name a rank that stops making progress, where it is (its stack) and who waits for it; end the job, or report.

    A hook costs one assignment; lit_accel's strategies mark each training batch's start themselves
    (:meth:`mark_steps`), so Lightning dispatches one per-batch hook of it. Only ``fit`` is watched; a second instance
    stays passive. See docs/reliability.md.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, callbacks=[HangWatchdog(timeout=60)])

    Args:
        timeout: seconds a training step (forward, backward, optimizer step), or the time between two, may take.
        first_step_timeout: the same for set-up and the first training step (compilation, lazy communicator set-up).
        validation_timeout: for each validation (and sanity-check) batch, and for the work after the last one.
        checkpoint_timeout: from ``on_save_checkpoint`` until the next phase starts (writing the file).
        interval: seconds between two publications of a rank's state.
        on_hang: ``"exit"`` ends every rank with code 124 after the report; ``"report"`` prints it once per stall.
    """

    def __init__(
        self,
        timeout: float = 30.0,
        first_step_timeout: float = 600.0,
        validation_timeout: float = 600.0,
        checkpoint_timeout: float = 600.0,
        *,
        interval: float = 1.0,
        on_hang: Literal["exit", "report"] = "exit",
    ) -> None:
        self.watchdog = ProgressWatchdog(timeout, interval=interval, on_hang=on_hang, owner="HangWatchdog")
        longer = {"first_step": first_step_timeout, "validation": validation_timeout, "checkpoint": checkpoint_timeout}
        for name, value in longer.items():
            check_number("HangWatchdog", f"{name}_timeout", value, fix=f"pass seconds, e.g. {name}_timeout=600")
        self.timeout = float(timeout)
        self.first_step_timeout, self.validation_timeout, self.checkpoint_timeout = map(float, longer.values())
        self._active, self._step, self._step_allowance = False, 0, self.first_step_timeout
        idle_unused(self)  # the backward's and the optimizer's hooks: Lightning's dispatch skips them

    @property
    def report(self) -> HangReport | None:
        """The latest verdict of this fit, if a stall was found (with ``on_hang="report"``, the job went on)."""
        return self.watchdog.report

    def _enter(self, phase: str, allowance: float) -> None:
        if self._active:
            self.watchdog.enter(phase, self._step, allowance)

    # Started here, not in ``setup``: a strategy may append this callback in ``strategy.setup()``, after those hooks.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
        if first is not self:
            rank_zero_warn(f"HangWatchdog(timeout={self.timeout:g}) stays passive: the Trainer has another one"
                           f" (timeout={first.timeout:g}). Fix: pass a single HangWatchdog.")  # fmt: skip
            return
        self._active, self._step, self._step_allowance = True, trainer.global_step, self.first_step_timeout
        self._enter("setup", self.first_step_timeout)
        self.watchdog.start([proc for _, proc in launched_child_processes(trainer.strategy)])

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step = trainer.global_step  # restored from a checkpoint after on_fit_start

    def mark_steps(self) -> bool:
        """The caller (a strategy) marks each training batch's start itself; True if it is to.

        Then Lightning's dispatch leaves out ``on_train_batch_start`` (a profiler context per batch) until the fit ends;
        the batch's end stays with ``on_train_batch_end``, after the other callbacks' (a checkpoint saved there). False
        for a subclass that overrides the hook: it keeps running and the caller marks nothing.
        """
        if type(self).on_train_batch_start is not HangWatchdog.on_train_batch_start:
            return False
        idle(self, HangWatchdog, "on_train_batch_start")
        return True

    def batch_started(self) -> None:
        """A training batch starts: its forward, backward and optimizer step (the stack tells which)."""
        if self._active:  # self._step: set at the train start and at the last batch's end
            self.watchdog.enter("training_step", self._step, self._step_allowance)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batch_started()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step, self._step_allowance = trainer.global_step, self.timeout
        self._enter("data", self.timeout)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._enter("sanity_check" if trainer.sanity_checking else "validation", self.validation_timeout)

    on_validation_start = on_validation_batch_end = on_validation_batch_start

    @override
    def on_validation_end(self, *args: Any) -> None:
        self._enter("data", self._step_allowance)  # after the sanity check, the first step's allowance still holds

    @override
    def on_save_checkpoint(self, *args: Any) -> None:
        self._enter("checkpoint", self.checkpoint_timeout)

    # Also on an exception: after a verdict that ends the job, a peer's exit makes a collective raise; stop() ends us.
    @override
    def on_train_end(self, *args: Any, **kwargs: Any) -> None:  # teardown (loggers, the strategy's) has no phases
        wake(self, "on_train_batch_start")  # the next fit's strategy may not mark it
        if self._active:
            self.watchdog.stop()
            self._active = False

    on_exception = teardown = on_train_end


def add_hang_watchdog(trainer: pl.Trainer, timeout: float | None) -> HangWatchdog:
    """What lit_accel's strategies add: ending the job after ``timeout`` s, or (``None``) a report-only watchdog.

    Returns the watchdog that watches this fit: the Trainer's first (a user's own wins), else the one added.
    """
    first = next((cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog)), None)
    if first is not None:
        return first
    if timeout is None:  # a default must never end a healthy job: it reports a long stall, once
        added = HangWatchdog(REPORT_AFTER_S, on_hang="report")
    else:
        longer = max(600.0, timeout)
        added = HangWatchdog(timeout, longer, longer, longer, interval=min(1.0, timeout / 10))
    trainer.callbacks.append(added)
    return added
