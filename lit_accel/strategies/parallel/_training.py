"""``OneStageBatch``: the global batch without a pipeline dimension, through the shared ``GlobalBatch`` part.

Without a pipeline, AccelParallel accumulates as AccelFSDP does (Lightning's ``accumulate_grad_batches``, FSDP's sync
off for all but the window's last backward, a short last window averaged over its own micro-batches), the
data-parallel size being the mesh's data dimension. With one, the rule is ``_batch.py``'s and this only reads the
loaded batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from lit_accel.strategies._global_batch import GlobalBatch
from lit_accel.strategies.batch_plan import loaded_batch_size_of

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from torch.optim import Optimizer

    from lit_accel.strategies.parallel._layout import ParallelLayout

__all__ = ["OneStageBatch"]


class OneStageBatch:
    """Accumulation and exact partial windows for AccelParallel without a pipeline dimension."""

    def __init__(
        self,
        owner: str,
        global_batch_size: int | None,
        micro_batch_size: int | None,
        partial_window: Literal["mean", "lightning"],
        pipelined: bool,
    ) -> None:
        self.owner = owner
        self.pipelined = pipelined
        # Under a pipeline micro_batch_size is the pipeline's micro-batch, not an accumulation step.
        micro = None if pipelined else micro_batch_size
        self._global = GlobalBatch(owner, None if pipelined else global_batch_size, micro, partial_window)

    def at_setup(self, trainer: pl.Trainer, module: pl.LightningModule, layout: ParallelLayout) -> None:
        """Apply the accumulation when it is already known (``micro_batch_size`` given)."""
        if not self.pipelined:
            self._global.at_setup(trainer, module, layout.data)

    def at_train_start(
        self, trainer: pl.Trainer, module: pl.LightningModule | None, layout: ParallelLayout, device: torch.device,
        has_lr_schedulers: bool,
    ) -> int | None:  # fmt: skip
        """The loaded batch size per data-parallel rank; without a pipeline the accumulation is applied too."""
        if self.pipelined:
            return loaded_batch_size_of(trainer.train_dataloader)
        loaded = self._global.at_train_start(trainer, module, layout.data, device, has_lr_schedulers)
        declared = self._global.micro_batch_size
        if declared is not None and loaded is not None and loaded > declared:
            raise ValueError(
                f"{self.owner}(micro_batch_size={declared}) is smaller than the loader's batch_size={loaded}; without a"
                f" pipeline AccelParallel does not split loaded batches. Fix: DataLoader(batch_size={declared})."
            )
        return loaded

    def count_micro_batch(self) -> None:
        """One more micro-batch in the current window."""
        self._global.window_micro_batches += 1

    def wrap_closure(
        self, closure: Callable[[], Any], optimizer: Optimizer, accumulation: int, module: pl.LightningModule | None
    ) -> Callable[[], Any]:
        """The closure that rescales a short last window (``partial_window="mean"``)."""
        if self.pipelined:
            return closure
        automatic = module is None or module.automatic_optimization
        return self._global.wrap_closure(closure, optimizer, accumulation, automatic)

    def window_done(self) -> None:
        """The optimizer stepped: a new window starts."""
        self._global.window_micro_batches = 0
