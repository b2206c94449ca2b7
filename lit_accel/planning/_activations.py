"""The activation memory of a layout's largest rank: one fake forward, measured as the ``MemoryMonitor`` does.

The module is copied with every parameter and buffer replaced by a fake tensor (``FakeTensorMode``: shapes, dtypes
and storages, no data, no allocation), its ``training_step`` runs on a fake copy of one device's batch, and the
MemoryMonitor's own probe (``SavedTensorProbe``: the unique storages autograd saves for the backward, parameters and
their casts apart) counts the bytes. Under a pipeline the forward runs on one micro-batch and each unit's saved
tensors are booked to its stage (the loss to the last), a rank holding the sum of its stages. Under tensor parallelism
the copy holds one rank's shards (a column-wise ``Linear`` with its rows split, a row-wise one with its columns, an
attention's head count divided, as ``apply_plan`` does), so the forward computes the shapes a rank computes; a plan
with other styles (sequence parallel, torch style objects) is not modelled (``None``). Activation checkpointing is
applied to the copy's blocks as the strategy applies it, so what the checkpointed blocks do not save is not counted.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lit_accel.layout.batch_plan import make_batch_plan
from lit_accel.layout.blocks import checkpoint_blocks, find_blocks
from lit_accel.layout.plan import COMPUTE_DTYPES
from lit_accel.layout.stages import pipeline_units, split_units
from lit_accel.layout.tensor_plan import head_attribute, resolve_plan
from lit_accel.meters.memory import SavedTensorProbe
from lit_accel.planning._peak import StepPeak, step_peak
from lit_accel.planning._state import tensor_dims
from lit_accel.utilities._batches import batch_length

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_accel.layout.plan import ParallelPlan

__all__ = ["Activations", "RankShape", "measure_shape", "rank_activations", "shape_key"]

OWNER = "lit_accel.plan"
_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def _fake_copy(module: nn.Module, mode: Any, dtype: torch.dtype | None) -> nn.Module:
    """``module`` deep-copied with fake parameters and buffers (floating ones in ``dtype`` when given).

    Copied outside ``mode``: other tensors the module holds (a metric's state) are copied as they are.
    """

    def fake(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        with mode:
            return torch.empty(t.shape, dtype=cast)

    memo: dict[int, Any] = {id(p): nn.Parameter(fake(p), requires_grad=p.requires_grad) for p in module.parameters()}
    memo.update({id(b): fake(b) for b in module.buffers()})
    return copy.deepcopy(module, memo)


def _fake_batch(batch: Any, dtype: torch.dtype | None, micro: int) -> Any:
    """The batch's tensors as fake ones (the first ``1/micro`` of their samples; floats in ``dtype`` when given)."""

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (t.shape[0] // micro, *t.shape[1:]) if t.dim() else t.shape
        return torch.empty(shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    return tree_map(fake, batch)


def _modelled(module: nn.Module, plan: ParallelPlan) -> bool:
    """Whether the tensor plan (if any) has only the column- and row-wise styles the copy can take."""
    if plan.layout.tensor == 1:
        return True
    styles = resolve_plan(OWNER, module, plan.tensor_plan, plan.layout.tensor)
    return all(style in ("colwise", "rowwise") for style in styles.values())


def _to_local_shards(shadow: nn.Module, plan: ParallelPlan) -> None:
    """One tensor rank's shapes: each split parameter replaced by its shard, attention head counts divided."""
    tensor, dims = plan.layout.tensor, tensor_dims(shadow, plan)
    for name, dim in dims.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = shadow.get_submodule(owner_name)
        param = getattr(owner, leaf)
        shape = list(param.shape)
        shape[dim] = -(-shape[dim] // tensor)
        setattr(owner, leaf, nn.Parameter(torch.empty(shape, dtype=param.dtype), requires_grad=param.requires_grad))
    for parent_name in {name.rpartition(".")[0].rpartition(".")[0] for name in dims}:
        parent = shadow.get_submodule(parent_name)
        heads = head_attribute(parent)
        if heads is not None:
            setattr(parent, heads, getattr(parent, heads) // tensor)


class _SavedByStage:
    """The bytes autograd saves in a forward, by the pipeline stage whose units saved them, and the last unit's output.

    Each stretch of the forward gets a probe of its own, booked to the stage running (before the first unit, the
    first; after the last, as the loss, the last). Without units (no pipeline) the whole forward is stage 0's.
    """

    def __init__(self, shadow: nn.Module, units: list[tuple[str, nn.Module]], stage_of: list[int]) -> None:
        self.params = list(shadow.parameters())
        self.units = units
        self.stage_of = stage_of
        self.bytes: dict[int, float] = defaultdict(float)
        self.output = 0.0
        self._stage: int | None = None
        self._probe: SavedTensorProbe | None = None
        self._handles: list[Any] = []

    def _enter(self, stage: int) -> None:
        if stage != self._stage:
            self._close()
            self._stage, self._probe = stage, SavedTensorProbe(self.params)
            self._probe.start()

    def _close(self) -> None:
        if self._probe is not None and self._stage is not None:
            self.bytes[self._stage] += self._probe.stop()[0].total
            self._probe = None

    def _output(self, out: Any) -> None:
        self.output += _nbytes(out)

    def __enter__(self) -> _SavedByStage:
        stage = {id(unit): self.stage_of[i] for i, (_, unit) in enumerate(self.units)}
        # first: a stage's probe must be outside the saved-tensor hooks of a checkpointed unit's own pre-hook
        self._handles = [unit.register_forward_pre_hook(lambda m, _: self._enter(stage[id(m)]), prepend=True)
                         for _, unit in self.units]  # fmt: skip
        if self.units:
            self._handles.append(self.units[-1][1].register_forward_hook(lambda m, i, out: self._output(out)))
        self._enter(0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()
        for handle in self._handles:
            handle.remove()


def _nbytes(value: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor)))


def _in_flight(plan: ParallelPlan, stage: int, micro: int) -> int:
    """Micro-batches whose activations ``stage`` holds at once.

    All under GPipe; else (1F1B and its kin) as many as the stages from it to the last (its warm-up forwards).
    """
    return micro if plan.schedule.name == "gpipe" else min(micro, plan.num_stages - stage)


@dataclass(frozen=True)
class Activations:
    """The largest rank's activations: one micro-batch's (the MemoryMonitor's figure) and at the step's peak."""

    #: bytes autograd saves in one forward (one micro-batch under a pipeline)
    per_micro_batch: float
    #: bytes held at once: a pipeline's in-flight micro-batches, and the last stage's outputs of every micro-batch
    held: float


@dataclass(frozen=True)
class RankShape:
    """What one rank shape's fake training step measured (the layouts whose ranks compute the same shapes share it).

    Under a pipeline the whole model runs one micro-batch, its saved bytes booked to the stages of the plan's split.
    """

    #: bytes autograd saves in the forward, by pipeline stage (all under 0 without a pipeline)
    saved: dict[int, float]
    #: bytes of the last unit's output (the schedule keeps the last stage's output of every micro-batch)
    output: float
    step: StepPeak


def shape_key(plan: ParallelPlan | None) -> tuple:
    """What decides a rank's shapes: the tensor size, a pipeline's stages and micro-batches, checkpointing, sharding."""
    if plan is None:
        return (None,)
    stages = None if plan.layout.pipeline == 1 else (plan.num_stages, repr(plan.stage_split), plan.microbatches)
    return (plan.layout.tensor, stages, plan.activation_checkpointing, plan.sharded)


def _prepared(module: pl.LightningModule, batch: Any, plan: ParallelPlan | None, precision: str) -> tuple[Any, ...]:
    """``(mode, shadow, fake batch, autocast context)``: one rank's fake copy, as the layout's build would leave it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    micro = 1
    if plan is not None and plan.layout.pipeline > 1:  # the strategy's count, refused as it refuses a batch
        micro = plan.pipeline_split(None)["micro_batches"]
        make_batch_plan(None, batch_length(batch), 1, micro_batches=micro, even_micro_batches=True, owner=OWNER)
    autocast = COMPUTE_DTYPES.get(precision)
    # FSDP computes in its MixedPrecisionPolicy's dtype (the autocast one): the gathered parameters are low precision
    params_dtype = _TRUE.get(precision) or (autocast if plan is not None and plan.sharded else None)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (a metric's real state meets the fake outputs)
    shadow = _fake_copy(module, mode, params_dtype)
    with mode:
        if plan is not None and plan.layout.tensor > 1:
            _to_local_shards(shadow, plan)
        if plan is not None and plan.activation_checkpointing is not False:  # as the strategy's build does
            blocks = find_blocks(OWNER, shadow, plan.shard_policy) if plan.activation_checkpointing is True else []
            checkpoint_blocks(OWNER, shadow, blocks, plan.activation_checkpointing)
        fake_batch = _fake_batch(batch, _TRUE.get(precision), micro)
    context = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    return mode, shadow, fake_batch, context


def measure_shape(module: pl.LightningModule, batch: Any, plan: ParallelPlan | None, precision: str,
                  optimizer_of: Callable[[nn.Module], torch.optim.Optimizer]) -> RankShape | None:  # fmt: skip
    """One training step of a fake copy at one rank's shapes (``plan``'s; ``None``: DDP's): its saved bytes and peak.

    ``batch``: one device's loaded batch. ``optimizer_of``: the module's optimizer over a copy's parameters. None
    where activations are not modelled (no batch, a tensor plan with other styles).
    """
    if batch is None or (plan is not None and not _modelled(module, plan)):
        return None
    mode, shadow, fake_batch, context = _prepared(module, batch, plan, precision)
    units, stage_of = _stages(shadow, plan) if plan is not None and plan.layout.pipeline > 1 else ([], [])
    with mode, context:
        saved = _SavedByStage(shadow, units, stage_of)
        step = step_peak(shadow, fake_batch, optimizer_of(shadow), watch=saved)
    return RankShape(dict(saved.bytes), saved.output, step)


def _stages(shadow: nn.Module, plan: ParallelPlan) -> tuple[list[tuple[str, nn.Module]], list[int]]:
    """The pipeline units of ``shadow`` and the stage of each, as the strategy splits them."""
    units = pipeline_units(shadow)
    starts = split_units(OWNER, [name for name, _ in units], units, plan.num_stages, plan.stage_split)
    return units, [sum(1 for s in starts if s <= i) - 1 for i in range(len(units))]


def rank_activations(plan: ParallelPlan | None, shape: RankShape) -> Activations:
    """The largest rank's activations under ``plan`` from its rank shape's measurement."""
    stages = defaultdict(float, shape.saved)
    if plan is None or plan.layout.pipeline == 1:
        return Activations(stages[0], stages[0])
    micro = plan.pipeline_split(None)["micro_batches"]
    last = plan.num_stages - 1
    ranks = [plan.stage_ids(rank) for rank in range(plan.layout.pipeline)]
    one = max(sum(stages[s] for s in ids) for ids in ranks)
    held = max(sum(stages[s] * _in_flight(plan, s, micro) + (shape.output * micro if s == last else 0.0) for s in ids)
               for ids in ranks)  # fmt: skip
    return Activations(one, held)
