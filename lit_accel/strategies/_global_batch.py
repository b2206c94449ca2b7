"""``GlobalBatch``: a strategy's gradient accumulation, from ``global_batch_size`` to exact partial windows.

A strategy calls it at setup (the accumulation is known when ``micro_batch_size`` is given), at fit start (read
from the train dataloader), on every micro-batch (to count the window) and at every optimizer step (to average a
short last window over the micro-batches it really had). The arithmetic lives in ``_accumulation.py``; nothing here
depends on how gradients are reduced, so DDP and FSDP share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_accel.strategies._accumulation import AccumulationPlan, micro_batch_size_of, plan_accumulation
from lit_accel.utilities._validation import check_choice, check_int
from lit_accel.utilities._workarounds import rescale_partial_window_

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["GlobalBatch"]


class GlobalBatch:
    """The accumulation a strategy applies to the Trainer, and the micro-batch count of the current window.

    Args:
        owner: the strategy's class name, for messages.
        global_batch_size: samples per optimizer step over all devices, or ``None`` to keep the Trainer's
            ``accumulate_grad_batches``.
        micro_batch_size: per-device batch size when known up front (else read from the train dataloader).
        partial_window: ``"mean"`` (average a short last window over its micro-batches) or ``"lightning"``.

    Raises:
        ValueError: ``micro_batch_size`` without ``global_batch_size``, or an unknown ``partial_window``.
        TypeError: a size that is not an int.

    Example::

        accumulation = GlobalBatch("AccelDDP", global_batch_size=1024, micro_batch_size=32)
        accumulation.at_setup(trainer, module, world_size=4)  # trainer.accumulate_grad_batches becomes 8
    """

    def __init__(
        self,
        owner: str,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
    ) -> None:
        check_int(owner, "global_batch_size", global_batch_size, allow_none=True, example=1024)
        check_int(owner, "micro_batch_size", micro_batch_size, allow_none=True, example=32)
        check_choice(owner, "partial_window", partial_window, ("mean", "lightning"), "'mean'")
        if micro_batch_size is not None and global_batch_size is None:
            raise ValueError(
                f"{owner}(micro_batch_size={micro_batch_size}) only serves global_batch_size, which is None. Fix: pass"
                " global_batch_size, or drop micro_batch_size (the dataloader's batch size is used)."
            )
        self.owner = owner
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.partial_window = partial_window
        #: The per-device micro-batch size once known (construction, setup or fit start).
        self.resolved_micro_batch_size: int | None = micro_batch_size
        self._user_accumulation = 1
        self._applied_accumulation: int | None = None
        self.window_micro_batches = 0  # micro-batches since the last optimizer step

    # ------------------------------------------------------------------ setup and fit start

    def at_setup(self, trainer: pl.Trainer, module: pl.LightningModule | None, world_size: int) -> None:
        """Remember the user's accumulation, and apply the plan when the micro-batch is already known."""
        if trainer.accumulate_grad_batches != self._applied_accumulation:
            self._user_accumulation = trainer.accumulate_grad_batches
        if self.global_batch_size is None:
            return
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                f"{self.owner}(global_batch_size={self.global_batch_size}) sets the accumulation itself, which"
                " contradicts the GradientAccumulationScheduler callback. Fix: drop one of them."
            )
        if self.micro_batch_size is not None:
            try:
                plan = plan_accumulation(self.global_batch_size, self.micro_batch_size, world_size)
            except ValueError:
                return  # the loader's batches may be larger and split to micro_batch_size: decided at fit start
            self._apply(trainer, module, plan)

    def at_train_start(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule | None,
        world_size: int,
        device: torch.device,
        has_lr_schedulers: bool,
    ) -> int | None:
        """Read the loaded batch size from the train dataloader and apply the plan (one all-reduce when it is read).

        Returns the per-device size of a loaded batch (``None`` when unknown). A declared ``micro_batch_size``
        smaller than it means each loaded batch is split into micro-batches (the strategy's ``MicroBatching``), and
        the accumulation counts loaded batches.
        """
        self.window_micro_batches = 0
        loaded = micro_batch_size_of(trainer.train_dataloader)
        declared = self.micro_batch_size
        if declared is not None and loaded is not None and loaded < declared:
            raise ValueError(
                f"{self.owner}(micro_batch_size={declared}) disagrees with the train dataloader's batch_size={loaded}."
                " Fix: make them equal, give the loader larger batches to split, or drop micro_batch_size."
            )
        if self.global_batch_size is None:
            self.resolved_micro_batch_size = declared or loaded
            return loaded
        if declared is not None and (loaded is None or loaded == declared):
            if self._applied_accumulation is None:  # it did not divide at setup: say so now
                self._apply(trainer, module, plan_accumulation(self.global_batch_size, declared, world_size))
            return loaded or declared  # the plan applied at setup holds
        if loaded is None:
            raise ValueError(
                f"{self.owner}(global_batch_size={self.global_batch_size}): the train dataloader has no readable"
                f" batch_size (batch_size or batch_sampler.batch_size). Fix: pass {self.owner}(micro_batch_size=...)."
            )
        self._check_same_on_all_ranks(loaded, world_size, device)
        before = trainer.accumulate_grad_batches
        self._apply(trainer, module, plan_accumulation(self.global_batch_size, loaded, world_size))
        self.resolved_micro_batch_size = declared or loaded
        if has_lr_schedulers and trainer.accumulate_grad_batches != before:
            rank_zero_warn(
                f"{self.owner}: the accumulation was set at fit start, after configure_optimizers, so"
                " trainer.estimated_stepping_batches there counted every micro-batch. Fix: pass micro_batch_size=..."
            )
        return loaded

    def _apply(self, trainer: pl.Trainer, module: pl.LightningModule | None, plan: AccumulationPlan) -> None:
        if self._user_accumulation not in (1, plan.accumulate_grad_batches):
            raise ValueError(
                f"{self.owner}(global_batch_size={plan.global_batch_size}) gives accumulate_grad_batches="
                f"{plan.accumulate_grad_batches} ({plan.describe()}), not Trainer(accumulate_grad_batches="
                f"{self._user_accumulation}). Fix: drop one of them."
            )
        if plan.accumulate_grad_batches > 1 and module is not None and not module.automatic_optimization:
            # Lightning refuses accumulate_grad_batches > 1 with manual optimization before this point, and its manual
            # loop ignores the setting: every opt.step() would still see one micro-batch per device.
            raise ValueError(
                f"{self.owner}(global_batch_size={plan.global_batch_size}) needs accumulate_grad_batches="
                f"{plan.accumulate_grad_batches}, but {type(module).__name__} uses manual optimization, where"
                f" Lightning does not accumulate. Fix: use global_batch_size={plan.micro_batch_size * plan.world_size},"
                " or accumulate in your training_step."
            )
        trainer.accumulate_grad_batches = plan.accumulate_grad_batches
        self._applied_accumulation = plan.accumulate_grad_batches
        self.resolved_micro_batch_size = plan.micro_batch_size
        rank_zero_info(f"{self.owner}: {plan.describe()}")

    def _check_same_on_all_ranks(self, micro_batch_size: int, world_size: int, device: torch.device) -> None:
        if world_size == 1 or not dist.is_initialized():
            return
        # One all-reduce at fit start: max over ranks of (m, -m) gives the largest and the smallest.
        extremes = torch.tensor([micro_batch_size, -micro_batch_size], device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        largest, smallest = int(extremes[0]), -int(extremes[1])
        if largest != smallest:
            raise ValueError(
                f"{self.owner}(global_batch_size={self.global_batch_size}): the train dataloaders' batch sizes"
                f" differ between ranks (from {smallest} to {largest}), so no accumulation fits all of them. Fix: give"
                " every rank the same batch_size."
            )

    def global_size(self, accumulation: int, world_size: int) -> int | None:
        """Samples per optimizer step over all devices: the configured value, else micro x accumulation x world."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        micro = self.resolved_micro_batch_size
        return None if micro is None else micro * accumulation * world_size

    # ------------------------------------------------------------------ per step

    def wrap_closure(
        self, closure: Callable[[], Any], optimizer: Optimizer, accumulation: int, automatic: bool
    ) -> Callable[[], Any]:
        """The closure to step with: with ``"mean"``, one that rescales a short window from 1/k to 1/m."""
        if self.partial_window != "mean" or accumulation <= 1 or not automatic:
            return closure

        def corrected_closure() -> Any:
            # Runs the final micro-batch's forward and backward (its gradient sync included), then - before the
            # precision plugin unscales, clips and steps - rescales a short window from 1/k to 1/m per micro-batch.
            output = closure()
            params = (p for group in optimizer.param_groups for p in group["params"])
            rescale_partial_window_(params, accumulation, self.window_micro_batches)
            return output

        return corrected_closure
