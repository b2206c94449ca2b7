"""The model state each rank of a layout holds: parameters, gradients and optimizer state, in bytes.

Worked out from the model's parameter shapes alone (a model on the meta device plans as well as a real one), with the
decisions the strategies make (``lit_accel/layout/``): the pipeline split (``split_units``, the plan's ``stage_ids``),
the tensor plan (``resolve_plan``: a column-wise ``Linear`` shards its weight's rows and its bias, a row-wise one its
weight's columns, an ``Embedding`` the other way round) and FSDP's dim-0 shards over the data-sharded ranks (rank 0
holds the rounded-up share, the largest). The optimizer is the module's own ``configure_optimizers``, stepped once on
meta copies of the parameters, so its state per parameter is what torch allocates (momentum, Adam's two moments, the
step counter). Each category is the maximum over ranks, as the ``MemoryMonitor`` reports it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lit_accel.layout.blocks import find_blocks
from lit_accel.layout.stages import pipeline_units, split_units, stage_ranges
from lit_accel.layout.tensor_plan import resolve_plan
from lit_accel.utilities._memory import meta_step_states

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_accel.layout.plan import ParallelPlan

__all__ = ["gathered_bytes", "optimizer_bytes", "state_bytes", "tensor_dims", "the_optimizer"]

# the dim of a weight each named style shards, by module class (torch's ColwiseParallel/RowwiseParallel)
_SHARDED_DIM = {("colwise", nn.Linear): 0, ("rowwise", nn.Linear): 1, ("colwise", nn.Embedding): 1,
                ("rowwise", nn.Embedding): 0}  # fmt: skip


class _TrainerBeforeLaunch:
    """What ``configure_optimizers`` commonly reads of its trainer, before there is one (a schedule's length)."""

    estimated_stepping_batches = 1
    max_epochs = 1
    max_steps = -1
    current_epoch = 0
    global_step = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = self.num_devices = world_size


def _configured(owner: str, module: pl.LightningModule, world_size: int) -> Any:
    """``configure_optimizers()``, with a stand-in trainer when the module has none (it only builds the optimizer)."""
    try:
        module.trainer  # noqa: B018  (raises when the module is not attached)
    except RuntimeError:
        pass
    else:
        return module.configure_optimizers()  # attached: its own trainer (left attached)
    module.trainer = _TrainerBeforeLaunch(world_size)  # type: ignore[assignment]
    try:
        return module.configure_optimizers()
    except AttributeError as error:
        raise TypeError(
            f"{owner}: {type(module).__name__}.configure_optimizers() read {error.name!r} of its trainer, which is"
            " not known before launch. Fix: read it only for the scheduler, with a default when it is missing."
        ) from error
    finally:
        module.trainer = None  # type: ignore[assignment]


def the_optimizer(owner: str, module: pl.LightningModule, world_size: int) -> torch.optim.Optimizer:
    """The first optimizer ``configure_optimizers`` returns (any of Lightning's return forms)."""
    found: Any = _configured(owner, module, world_size)
    if isinstance(found, dict):
        found = found["optimizer"]
    while isinstance(found, (list, tuple)) and found:
        found = found[0]
    if isinstance(found, dict):
        found = found["optimizer"]
    if isinstance(found, LightningOptimizer):
        found = found.optimizer
    if not isinstance(found, torch.optim.Optimizer):
        raise TypeError(
            f"{owner}: {type(module).__name__}.configure_optimizers() returned {type(found).__name__}, not an"
            " optimizer. Fix: return a torch.optim.Optimizer (alone, in a list, or in a dict under 'optimizer')."
        )
    return found


def optimizer_bytes(owner: str, module: pl.LightningModule, world_size: int) -> dict[str, tuple[float, float]]:
    """Per parameter name: (bytes per element of its state, bytes of its scalar state) after one optimizer step."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for param, state in meta_step_states(the_optimizer(owner, module, world_size)):
        per_element = sum(t.element_size() for t in state if t.numel() == param.numel() > 1)
        scalar = sum(t.numel() * t.element_size() for t in state if not (t.numel() == param.numel() > 1))
        out[names.get(id(param), str(id(param)))] = (float(per_element), float(scalar))
    return out


def _owned_names(module: nn.Module, plan: ParallelPlan, pipeline_rank: int) -> set[str] | None:
    """The parameter names pipeline rank ``pipeline_rank`` holds (None: every one, without a pipeline)."""
    if plan.layout.pipeline == 1:
        return None
    units = pipeline_units(module)
    names = [name for name, _ in units]
    starts = split_units("lit_accel.plan", names, units, plan.num_stages, plan.stage_split)
    ranges = stage_ranges(starts, len(units))
    kept = [names[i] for sid in plan.stage_ids(pipeline_rank) for i in ranges[sid]]
    return {f"{unit}.{p}" for unit in kept for p, _ in module.get_submodule(unit).named_parameters()}


def tensor_dims(module: nn.Module, plan: ParallelPlan) -> dict[str, int]:
    """Per parameter name: the dim the tensor plan shards (parameters it leaves whole are absent)."""
    styles = resolve_plan("lit_accel.plan", module, plan.tensor_plan, plan.layout.tensor)
    dims = {}
    for name, style in styles.items():
        sub = module.get_submodule(name)
        dim = next((d for (s, cls), d in _SHARDED_DIM.items() if s == style and isinstance(sub, cls)), None)
        if dim is None:
            continue  # a sequence style (its norm's parameters stay replicated) or a torch ParallelStyle object
        dims[f"{name}.weight"] = dim
        if dim == 0 and isinstance(sub, nn.Linear) and sub.bias is not None:
            dims[f"{name}.bias"] = 0  # a column-wise Linear's bias is split with its rows; a row-wise one's is not
    return dims


def _local_numel(shape: torch.Size, tensor_dim: int | None, tensor: int, shards: int) -> int:
    """Elements of rank 0's piece: the tensor dim split, then FSDP's dim 0 (rounded up)."""
    dims = list(shape) or [1]
    if tensor_dim is not None:
        dims[tensor_dim] = math.ceil(dims[tensor_dim] / tensor)
    dims[0] = math.ceil(dims[0] / shards)
    return math.prod(dims)


def state_bytes(
    module: nn.Module, plan: ParallelPlan | None, dtype: torch.dtype, optimizer: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """``params``/``grads``/``optimizer`` bytes of the largest rank (``plan`` None: DDP, every rank holds all)."""
    size = torch.empty((), dtype=dtype).element_size()
    params = dict(module.named_parameters())
    if plan is None:
        return _totals(params, None, {}, 1, 1, size, optimizer)
    layout = plan.layout
    shards = layout.data_shard if plan.sharded else 1
    dims = tensor_dims(module, plan) if layout.tensor > 1 else {}
    ranks = [_totals(params, _owned_names(module, plan, pp), dims, layout.tensor, shards, size, optimizer)
             for pp in range(layout.pipeline)]  # fmt: skip
    return {key: max(rank[key] for rank in ranks) for key in ("params", "grads", "optimizer")}


def _totals(params: dict[str, nn.Parameter], owned: set[str] | None, dims: dict[str, int], tensor: int, shards: int,
            size: int, optimizer: dict[str, tuple[float, float]]) -> dict[str, float]:  # fmt: skip
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for name, param in params.items():
        if owned is not None and name not in owned:
            continue
        local = _local_numel(param.shape, dims.get(name), tensor, shards)
        out["params"] += local * size
        if param.requires_grad:
            out["grads"] += local * size
        per_element, scalar = optimizer.get(name, (0.0, 0.0))
        out["optimizer"] += local * per_element + scalar
    return out


def gathered_bytes(module: nn.Module, plan: ParallelPlan | None, params: float, dtype: torch.dtype) -> float:
    """Bytes of unsharded parameters FSDP holds while a step computes on the largest rank (0 when not sharded).

    Over one data rank too: FSDP then copies each parameter into its unsharded buffer instead of gathering it.
    ``params``: the rank's sharded parameter bytes (``state_bytes``). ZeRO-3 (resharding after the forward) holds the
    root's own parameters (never resharded) and two blocks (the one computing and the one prefetched); without
    resharding (a pipeline's stages) the rank's whole stage stays gathered. In ``dtype``, FSDP's compute dtype.
    """
    if plan is None or not plan.sharded:
        return 0.0
    tensor, pipeline = plan.layout.tensor, plan.layout.pipeline
    per = torch.empty((), dtype=dtype).element_size()
    stored = next((p.element_size() for p in module.parameters()), per)
    unsharded = params * plan.layout.data_shard * per / stored  # the rank's piece, gathered
    if not plan.reshard_after_forward:
        return unsharded
    found = find_blocks("lit_accel.plan", module, plan.shard_policy)
    blocks = [sum(p.numel() for p in block.parameters()) * per / tensor for block in found]
    root = max(0.0, unsharded - sum(blocks) / pipeline)
    return root + 2 * max(blocks, default=0.0)
