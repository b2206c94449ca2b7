"""``PipelineRunner``: one optimizer step's forward and backward through the pipeline, as one ``schedule.step()``.

The loaded batch (one data-parallel rank's share of the global batch) is split into ``m`` equal micro-batches and fed
to a single ``step()`` with ``scale_grads=False``; each micro-batch's mean loss is weighted by ``1 / m`` (times the
fp16 loss scale) once, so the accumulated gradient is the mean over the batch, and FSDP reduces once (its
``set_requires_gradient_sync`` is torch's business inside ``step()``). Two ``step()`` calls per optimizer step with
``scale_grads=True`` would divide gradients already accumulated (the pitfall of torchtitan #1733).

torch's stages size their receive buffers from the first batch they see, so each batch size (the short last batch of
an epoch) gets its own stages and schedule; such a batch is split into the count of equal micro-batches nearest to
``m`` that the schedule accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lit_accel.layout.schedules import ScheduleSpec, valid_microbatches
from lit_accel.meters.pipeline_bubble import BubbleMeter, Order, single_stage_order, torch_order
from lit_accel.strategies.sharded._stage import ParallelCommStats, TimedStage

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor

    from lit_accel.layout.stages import StageModule

__all__ = ["PipelineRunner", "split_batch"]


def split_batch(module: pl.LightningModule, batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch: the module's ``pipeline_batch(batch)`` if it has one, else a pair."""
    hook = getattr(module, "pipeline_batch", None)
    if hook is not None:
        return hook(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"AccelParallel: under a pipeline dimension a batch must be (inputs, target), got {type(batch).__name__}."
        f" Fix: define {type(module).__name__}.pipeline_batch(batch) returning (inputs, target)."
    )


class _WeightedLoss:
    """The schedule's ``loss_fn``: the module's ``pipeline_loss`` of one micro-batch times the step's weight."""

    def __init__(self, loss: Callable[[Any, Any], Tensor]) -> None:
        self.loss = loss
        self.weight: float | Tensor = 1.0

    def __call__(self, output: Any, target: Any) -> Tensor:
        return self.loss(output, target) * self.weight


class PipelineRunner:
    """This rank's stages, and a schedule per batch size, run for training and evaluation.

    Args:
        owner: the strategy's class name, for messages.
        spec: the schedule.
        modules: this rank's stage modules, in stage order.
        num_stages: stages in the whole pipeline.
        group: the pipeline process group.
        device: this rank's device.
        microbatches: micro-batches per full batch.
        loss: the LightningModule's ``pipeline_loss``.
        comm: the strategy's comm stats, which count the stages' sends.
    """

    def __init__(
        self,
        owner: str,
        spec: ScheduleSpec,
        modules: list[StageModule],
        num_stages: int,
        group: Any,
        device: torch.device,
        microbatches: int,
        loss: Callable[[Any, Any], Tensor],
        comm: ParallelCommStats,
    ) -> None:
        self.owner = owner
        self.spec = spec
        self.modules = modules
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.microbatches = microbatches
        self.last_microbatches = 1  # of the last training step (the planned count may not divide every batch)
        self.pipeline = dist.get_world_size(group)
        self.stages_per_rank = len(modules)
        self._loss = _WeightedLoss(loss)
        self._comm = comm
        #: This rank's busy and wall time in the pipeline (``lit_accel.meters.pipeline_bubble``).
        self.meter = BubbleMeter(device, dist.get_rank(group), num_stages)
        self._schedules: dict[tuple[int, bool], tuple[Any, int, Order]] = {}
        self._held: list[tuple[Tensor, Tensor]] = []

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return any(m.index == self.num_stages - 1 for m in self.modules)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank takes the inputs."""
        return any(m.index == 0 for m in self.modules)

    def _schedule(self, batch_size: int, train: bool) -> tuple[Any, int, Order]:
        key = (batch_size, train)
        if key not in self._schedules:
            count = valid_microbatches(self.spec, batch_size, self.microbatches, self.pipeline, self.stages_per_rank)
            if count == 0:
                raise RuntimeError(
                    f"{self.owner}(schedule={self.spec.name!r}): a batch of {batch_size} samples splits into no"
                    " micro-batch count the schedule accepts. Fix: DataLoader(drop_last=True), or another schedule."
                )
            stages = [
                TimedStage(
                    m, m.index, self.num_stages, self.device, group=self.group, meter=self.meter, comm=self._comm
                )
                for m in self.modules
            ]
            schedule = self.spec.build(self.owner, stages, count, self._loss)
            order = (
                torch_order(schedule.pipeline_order)
                if self.spec.multi
                else single_stage_order(self.spec.name, self.pipeline, count)
            )
            self._schedules[key] = (schedule, count, order)
        return self._schedules[key]

    def _run(self, batch: Any, module: pl.LightningModule, train: bool, scale: Tensor | None) -> Tensor:
        inputs, target = split_batch(module, batch)
        size = _batch_size(inputs)
        schedule, count, order = self._schedule(size, train)
        self._loss.weight = 1.0 / count if scale is None else scale / count
        losses: list[Tensor] = []
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        kwargs: dict[str, Any] = {"target": target, "losses": losses}
        if not self.has_first_stage:
            args = ()
        if not self.has_last_stage:
            kwargs = {}
        if train:
            self.last_microbatches = count
            self.meter.step_start(order)
            schedule.step(*args, **kwargs)
            self.meter.step_end()
        else:
            schedule.eval(*args, **kwargs)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else None
        if total is not None and scale is not None:
            total = total / scale
        return self._share(total)

    def _share(self, total: Tensor | None) -> Tensor:
        """The batch's mean loss on every pipeline rank (summed from the last stage's; a device collective)."""
        value = total if total is not None else torch.zeros((), device=self.device)
        dist.all_reduce(value, group=self.group)
        return value

    def train_step(self, batch: Any, module: pl.LightningModule, scale: Tensor | None = None) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; returns the batch's mean loss (detached).

        The gradients are held aside until :meth:`restore_gradients`: Lightning's closure zeroes them between
        ``training_step`` and ``backward``, and the step must start from none (Lightning zeroes them after it).
        """
        params = [p for m in self.modules for p in m.parameters()]
        for param in params:
            param.grad = None
        loss = self._run(batch, module, train=True, scale=scale)
        self._held = [(p, p.grad) for p in params if p.grad is not None]
        for param, _ in self._held:
            param.grad = None
        return loss

    def backward_hooks(self, strategy: pl.strategies.Strategy, closure_loss: Tensor) -> Tensor:
        """Lightning's ``backward`` of this step: the hooks around it, and the last :meth:`train_step`'s gradients back.

        The schedule ran every backward inside ``training_step``; only the hooks are left to call.
        """
        module = strategy.lightning_module
        assert module is not None
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        self.restore_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def restore_gradients(self) -> None:
        """Put back the gradients of the last :meth:`train_step`."""
        for param, grad in self._held:
            param.grad = grad
        self._held = []

    def validation_step(self, batch: Any, module: pl.LightningModule) -> Tensor:
        """The batch's mean loss (no gradients), logged as ``val_loss`` over the world."""
        with torch.no_grad():
            loss = self._run(batch, module, train=False, scale=None)  # the mean loss on every pipeline rank
        for stage_module in self.modules:  # unsharded by the forward (no backward reshards them): free them again
            _reshard(stage_module)
        module.log("val_loss", loss, sync_dist=True)
        return loss


def _reshard(module: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _batch_size(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    if not isinstance(first, torch.Tensor):
        raise TypeError(
            f"AccelParallel: the pipeline's first input must be a tensor, got {type(first).__name__}."
            " Fix: make the batch's first element the model input tensor (the target follows it)."
        )
    return first.shape[0]
