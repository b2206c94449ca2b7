"""Find a stuck rank in seconds instead of at the 30-minute collective timeout: ``HangWatchdog``.

A thin adapter: Lightning's hooks mark the phases (data fetch, forward, backward, optimizer step, validation,
checkpoint) of :class:`~lit_accel.callbacks.progress_watchdog.ProgressWatchdog`, which does the watching.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lit_accel.callbacks._hang_diagnosis import HangReport
from lit_accel.callbacks.progress_watchdog import ProgressWatchdog
from lit_accel.utilities._compat import launched_child_processes
from lit_accel.utilities._validation import check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor

__all__ = ["HangWatchdog"]

Phase = Literal["setup", "sanity_check", "data", "forward", "backward", "optimizer_step", "validation", "checkpoint"]


class HangWatchdog(Callback):
    """End a job within seconds when a rank stops making progress, naming the rank, its phase and its stack.

    Every rank reports which rank is stuck (or that the ranks diverged into different collectives), in which phase,
    for how long, and the stuck rank's main-thread stack; the stuck rank dumps all its threads (and its forked
    DataLoader workers') to its own stderr. Then every rank exits with code 124. Works with any strategy; the step
    path costs a tuple assignment per hook, no collective and no device sync. Only ``fit`` is watched. With one
    process it still reports and exits. If a Trainer has several, only the first in ``trainer.callbacks`` runs.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, callbacks=[HangWatchdog(timeout=60)])

    Args:
        timeout: seconds a training phase (data fetch, forward, backward, optimizer step) may go without progress.
        first_step_timeout: the same for set-up, the sanity check and the first training batch (compilation,
            FLOP counting, lazy communicator set-up).
        validation_timeout: for each validation batch, and for the work after the last one.
        checkpoint_timeout: from ``on_save_checkpoint`` until the next phase starts (writing the file).
        interval: seconds between two publications of a rank's state; below every timeout.
        on_hang: ``"exit"`` ends the job; ``"report"`` only reports (the job then waits for the collective timeout).
        directory: a directory shared by the ranks, used only when there is no torch.distributed process group.

    Raises:
        TypeError, ValueError: an argument has the wrong type or value (the message names it and the fix).
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
        directory: str | os.PathLike | None = None,
    ) -> None:
        self.watchdog = ProgressWatchdog(
            timeout, interval=interval, on_hang=on_hang, directory=directory, owner="HangWatchdog"
        )
        allowances = {
            "first_step_timeout": first_step_timeout,
            "validation_timeout": validation_timeout,
            "checkpoint_timeout": checkpoint_timeout,
        }
        for name, value in allowances.items():
            check_number("HangWatchdog", name, value, fix=f"pass the seconds allowed without progress, e.g. {name}=600")
            if value < timeout:
                raise ValueError(
                    f"HangWatchdog({name}={value!r}): must be at least timeout={timeout!r} (it is the longer"
                    f" allowance). Fix: pass {name}={timeout!r} or more."
                )
        self.timeout = float(timeout)
        self.first_step_timeout = float(first_step_timeout)
        self.validation_timeout = float(validation_timeout)
        self.checkpoint_timeout = float(checkpoint_timeout)
        self._active = False
        self._step_allowance = self.first_step_timeout
        self._step: int = 0

    @property
    def report(self) -> HangReport | None:
        """The verdict of the last fit, if a hang was found (with ``on_hang="report"``, the job continued)."""
        return self.watchdog.report

    def _enter(self, phase: Phase, allowance: float) -> None:
        if self._active:
            self.watchdog.enter(phase, self._step, allowance)

    # Set-up happens here, not in ``setup``: a strategy may append this callback inside ``strategy.setup()``, which
    # runs after the callbacks' ``setup`` hooks.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
        self._active = first is self
        if not self._active:
            rank_zero_warn(
                f"HangWatchdog(timeout={self.timeout:g}) stays passive: the Trainer already has"
                f" HangWatchdog(timeout={first.timeout:g}), and two would report every hang twice."
                " Fix: pass a single HangWatchdog."
            )
            return
        self._step, self._step_allowance = trainer.global_step, self.first_step_timeout
        self.watchdog.enter("setup", self._step, self.first_step_timeout)
        children = [proc for _, proc in launched_child_processes(trainer.strategy)]
        self.watchdog.start(trainer.global_rank, trainer.world_size, children)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("sanity_check", self.validation_timeout)

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("setup", self.first_step_timeout)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("data", self._step_allowance)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step
        self._enter("forward", self._step_allowance)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._enter("backward", self._step_allowance)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("optimizer_step", self._step_allowance)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step, self._step_allowance = trainer.global_step, self.timeout
        self._enter("data", self.timeout)

    def _validation(self, trainer: pl.Trainer) -> None:
        self._enter("sanity_check" if trainer.sanity_checking else "validation", self.validation_timeout)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._validation(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._validation(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            self._enter("setup", self.first_step_timeout)
        else:
            self._enter("data", self._step_allowance)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._enter("checkpoint", self.checkpoint_timeout)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.watchdog.on_exception()  # a peer's coordinated exit after a hang report: let the watchdog end it
        self._stop()

    # After the last batch nothing is watched: teardown (loggers uploading, strategy teardown) has no phases.
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._active:
            self.watchdog.stop()
            self._active = False
