"""``HangWatchdog``: Lightning's progress counters and hooks give :class:`~lit_accel.meters.ProgressWatchdog` phases."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lit_accel.meters.progress_watchdog import HangReport, Position, ProgressWatchdog
from lit_accel.utilities._compat import launched_child_processes
from lit_accel.utilities._idle_hooks import idle_unused
from lit_accel.utilities._validation import check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["REPORT_AFTER_S", "HangWatchdog", "add_hang_watchdog"]

REPORT_AFTER_S = 300.0  #: seconds without progress after which the strategies' default watchdog reports a stall


class HangWatchdog(Callback):
    """Name a rank that stops making progress, where it is (its stack) and who waits for it; on request, end the job.

    Its thread reads the training loop's progress counters once per ``interval``: no hook runs per training batch. A
    validation batch or a checkpoint costs one assignment. Only ``fit`` is watched; a second instance stays passive.
    See docs/reliability.md.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, callbacks=[HangWatchdog(timeout=60, on_hang="exit")])

    Args:
        timeout: seconds a training step (forward, backward, optimizer step), or the time between two, may take.
        first_step_timeout: the same for set-up and the first training step (compilation, lazy communicator set-up).
        validation_timeout: for each validation (and sanity-check) batch, and for the work after the last one.
        checkpoint_timeout: from ``on_save_checkpoint`` until the next phase, or the next batch (writing the file).
        interval: seconds between two publications of a rank's state.
        on_hang: ``"report"`` (the default) prints the report once per stall and the job goes on; ``"exit"`` ends
            every rank with code 124 after it, with the launched ranks and the DataLoader workers, no other process.
    """

    def __init__(
        self,
        timeout: float = REPORT_AFTER_S,
        first_step_timeout: float = 600.0,
        validation_timeout: float = 600.0,
        checkpoint_timeout: float = 600.0,
        *,
        interval: float = 1.0,
        on_hang: Literal["report", "report"] = "report",
    ) -> None:
        self.watchdog = ProgressWatchdog(timeout, interval=interval, on_hang=on_hang, owner="HangWatchdog")
        longer = {"first_step": first_step_timeout, "validation": validation_timeout, "checkpoint": checkpoint_timeout}
        for name, value in longer.items():
            check_number("HangWatchdog", f"{name}_timeout", value, fix=f"pass seconds, e.g. {name}_timeout=600")
        self.timeout = float(timeout)
        self.first_step_timeout, self.validation_timeout, self.checkpoint_timeout = map(float, longer.values())
        self._active, self._trainer, self._first_done = False, None, None
        idle_unused(self)  # every per-batch hook: Lightning's dispatch skips them

    @property
    def report(self) -> HangReport | None:
        """The latest verdict of this fit, if a stall was found (with ``on_hang="report"``, the job went on)."""
        return self.watchdog.report

    def _enter(self, phase: str, allowance: float) -> None:
        if self._active:
            self.watchdog.enter(phase, self._trainer.global_step, allowance)

    def _position(self) -> Position:
        """Where the training loop stands, from its progress counters (read by the watchdog's thread)."""
        trainer = self._trainer
        batches = trainer.fit_loop.epoch_loop.batch_progress.total
        ready, done = batches.ready, batches.completed  # ready: fetched and on the device; completed: its hooks ran
        phase = "data" if ready == done else "training_step"  # forward, backward, optimizer step and the batch's hooks
        first = self._first_done is None or done == self._first_done  # set-up and this fit's first batch
        return Position(ready + done, phase, trainer.global_step, self.first_step_timeout if first else self.timeout)

    # Started here, not in ``setup``: a strategy may append this callback in ``strategy.setup()``, after those hooks.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
        if first is not self:
            rank_zero_warn(f"HangWatchdog(timeout={self.timeout:g}) stays passive: the Trainer has another one"
                           f" (timeout={first.timeout:g}). Fix: pass a single HangWatchdog.")  # fmt: skip
            return
        self._active, self._trainer, self._first_done = True, trainer, None
        self.watchdog.follow(self._position)
        self._enter("setup", self.first_step_timeout)
        self.watchdog.start([proc for _, proc in launched_child_processes(trainer.strategy)])

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._first_done = trainer.fit_loop.epoch_loop.batch_progress.total.completed  # restored from a checkpoint

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._enter("sanity_check" if trainer.sanity_checking else "validation", self.validation_timeout)

    on_validation_start = on_validation_batch_end = on_validation_batch_start

    @override
    def on_validation_end(self, *args: Any) -> None:
        if self._active:  # back to the training loop's position (after the sanity check: still the first step's)
            _, phase, step, allowance = self._position()
            self.watchdog.enter(phase, step, allowance)

    @override
    def on_save_checkpoint(self, *args: Any) -> None:
        self._enter("checkpoint", self.checkpoint_timeout)  # until the loop moves on: the next batch is fetched

    # Also on an exception: after a verdict that ends the job, a peer's exit makes a collective raise; stop() ends us.
    @override
    def on_train_end(self, *args: Any, **kwargs: Any) -> None:  # teardown (loggers, the strategy's) has no phases
        if self._active:
            self.watchdog.stop()
            self.watchdog.follow(None)
            self._active, self._trainer = False, None

    on_exception = teardown = on_train_end


def add_hang_watchdog(trainer: pl.Trainer, timeout: float | None) -> HangWatchdog:
    """What lit_accel's strategies add: ending the job after ``timeout`` s, or (``None``) a report-only watchdog.

    Returns the watchdog that watches this fit: the Trainer's first (a user's own wins), else the one added.
    """
    first = next((cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog)), None)
    if first is not None:
        return first
    if timeout is None:  # a default must never end a healthy job: it reports a long stall, once
        added = HangWatchdog()
    else:
        longer = max(600.0, timeout)
        added = HangWatchdog(timeout, longer, longer, longer, interval=min(1.0, timeout / 10), on_hang="exit")
    trainer.callbacks.append(added)
    return added
