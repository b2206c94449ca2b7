"""How AccelParallel turns the user's LightningModule into this rank's share: stages kept, TP applied, FSDP applied.

Order (torchtitan's): split into stages and drop the other ranks' units (before materialising, so a model built on
the meta device only ever allocates its own stage), convert for precision (fp8), tensor-parallelise, compile each
block (``compile=``), then shard over the data dimension block by block with each stage (without a pipeline: each
top-level unit under tensor parallelism, else the whole module, as AccelFSDP) as an FSDP root. A model whose
``configure_model`` applied ``fully_shard`` is left as it is (only without pipeline and tensor dimensions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lit_accel.layout import blocks as _blocks
from lit_accel.layout import stages as _stages
from lit_accel.layout import tensor_plan as _tensor_plan
from lit_accel.layout.chain import check_chain
from lit_accel.layout.tensor_check import PlanCheck
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.strategies.sharded import _fsdp_sharding as sharding
from lit_accel.utilities import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lit_accel.layout.plan import ParallelPlan

__all__ = ["BuildConfig", "ParallelModel", "build_parallel_model", "sync_layers"]


@dataclass(frozen=True)
class BuildConfig:
    """The strategy's arguments that shape the model."""

    owner: str
    #: the layout, the schedule, stages per rank, the split, the tensor plan and FSDP's policies, resolved
    plan: ParallelPlan
    #: with ``compile=``: called with the module and its blocks after TP, before FSDP (``AccelParts.compile_blocks``)
    compile_blocks: Callable[[nn.Module, list[nn.Module]], None] | None = None
    #: the LayerSync plugin resolved for this fit (SyncBatchNorm), applied to this rank's units before FSDP
    layer_sync: LayerSync | None = None


@dataclass
class ParallelModel:
    """This rank's share of the model once built."""

    #: this rank's pipeline stages (empty without a pipeline dimension)
    stages: list[_stages.StageModule]
    #: the outermost FSDP modules (their gradient sync is switched off while accumulating)
    fsdp_roots: list[nn.Module]
    #: the tensor plan's check against the unsharded model (armed for the first training forward), with a plan
    plan_check: PlanCheck | None = None
    #: the modules ``fully_shard`` was applied to, in that order (each root's blocks, then the root)
    sharded: list[nn.Module] = dataclasses.field(default_factory=list)


def _split(owner: str, module: pl.LightningModule, pp_rank: int, config: BuildConfig) -> dict[int, list[str]]:
    """Choose the stages, keep this rank's units; returns stage id -> unit names."""
    units = _stages.pipeline_units(module)
    names = [name for name, _ in units]
    check_chain(owner, module, names)  # before any unit is pruned: the stages must be the model's forward
    plan = config.plan
    num_stages = plan.num_stages
    starts = _stages.split_units(owner, names, units, num_stages, plan.stage_split)
    ranges = _stages.stage_ranges(starts, len(units))
    owned = {sid: [names[i] for i in ranges[sid]] for sid in plan.stage_ids(pp_rank)}
    _stages.prune_to(module, units, {name for unit_names in owned.values() for name in unit_names})
    described = ", ".join(f"stage {s}: {names[r[0]]}..{names[r[-1]]}" for s, r in enumerate(ranges))
    rank_zero_info(f"{owner}: {num_stages} pipeline stages ({described}).")
    return owned


def build_parallel_model(
    module: pl.LightningModule,
    mesh: DeviceMesh,
    rank: int,
    device: torch.device,
    precision: Any,
    config: BuildConfig,
) -> ParallelModel:
    """Stages, TP and FSDP applied to ``module`` in place for global rank ``rank``; the parts returned."""
    owner, layout = config.owner, config.plan.layout
    layered = layout.pipeline > 1 or layout.tensor > 1
    own_sharding = sharding.sharded_by_user(owner, module, layered)
    plan = _tensor_plan.resolve_plan(owner, module, config.plan.tensor_plan, layout.tensor)
    owned = _split(owner, module, layout.coordinates(rank)[0], config) if layout.pipeline > 1 else {}
    sync_layers(module, config.plan, config.layer_sync)
    _compat.materialize_distributed_module(module, device)
    precision.convert_module(module)
    module.to(device)
    tensor_modules, changed = _tensor_plan.apply_plan(module, mesh["tensor"], plan) if plan else ([], {})
    # every rank (a stage without parallelised modules too): the verdict is agreed over the world
    plan_check = PlanCheck(owner, module, tensor_modules, changed, mesh["tensor"].get_group()) if plan else None
    stages = [
        _stages.StageModule(sid, [(name, module.get_submodule(name)) for name in names]) for sid, names in owned.items()
    ]
    roots, sharded = (own_sharding, []) if own_sharding else _wrap_blocks(owner, module, stages, mesh, config)
    return ParallelModel(stages, roots, plan_check, sharded)


def sync_layers(module: nn.Module, plan: ParallelPlan, layer_sync: LayerSync | None) -> None:
    """SyncBatchNorm over each data dimension (never over a stage's or a tensor shard's peers), before FSDP."""
    if isinstance(layer_sync, AccelSyncBatchNorm):
        layer_sync.apply(module, plan.data_groups(layer_sync.group_size))
    elif layer_sync is not None and not isinstance(layer_sync, TorchSyncBatchNorm):  # (replaced by ours when fitting)
        layer_sync.apply(module)  # a user's plugin: the checks allowed it only where the data dimension is the world


def _wrap_blocks(owner: str, module: nn.Module, stages: list[_stages.StageModule], mesh: DeviceMesh,
                 config: BuildConfig) -> tuple[list[nn.Module], list[nn.Module]]:  # fmt: skip
    """This rank's blocks compiled, checkpointed and sharded (in that order): (FSDP roots, every sharded module)."""
    plan = config.plan
    shards = plan.sharded
    wanted = shards or config.compile_blocks is not None or plan.activation_checkpointing is True
    # this rank's blocks (the other stages' are pruned)
    blocks = _blocks.find_blocks(owner, module, plan.shard_policy) if wanted else []
    if config.compile_blocks is not None:
        config.compile_blocks(module, blocks)
    _blocks.checkpoint_blocks(owner, module, blocks, plan.activation_checkpointing)
    return _shard(module, stages, blocks, plan.layout.data_mesh(mesh), config) if shards else ([], [])


def _shard(
    module: nn.Module, stages: list[_stages.StageModule], blocks: list[nn.Module], data_mesh: DeviceMesh,
    config: BuildConfig,
) -> tuple[list[nn.Module], list[nn.Module]]:  # fmt: skip
    """FSDP over the data dimension: blocks first, then each stage, top-level unit or the whole module as a root.

    Each top-level unit under tensor parallelism (its modules' parameters are DTensors over another mesh); without
    pipeline and tensor dimensions the whole module, as AccelFSDP.
    """
    if stages:
        roots: list[nn.Module] = list(stages)
    elif config.plan.layout.tensor > 1:
        roots = [unit for _, unit in _stages.pipeline_units(module) if any(True for _ in unit.parameters())]
    else:
        roots = [module]
    sharded: list[nn.Module] = []
    for root in roots:
        inside = {id(m) for m in root.modules()}
        own_blocks = [b for b in blocks if id(b) in inside and b is not root]
        sharding.shard_model(root, data_mesh, own_blocks, config.plan)
        sharded += [*own_blocks, root]
    return roots, sharded
