"""How the sharded strategies shard: FSDP2's ``fully_shard`` per block and then on the root, and FSDP's dtypes.

The blocks are ``lit_accel/layout/blocks.py``'s (activation checkpointing, when asked, wrapped them first). They are
sharded innermost first, then the root, as torchtitan does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lit_accel.layout.plan import COMPUTE_DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lit_accel.layout.plan import ParallelPlan

__all__ = ["parameter_dtype", "shard_model", "sharded_by_user"]


def parameter_dtype(precision: object) -> torch.dtype | None:
    """FSDP's compute dtype for the parameters under ``precision`` (a Lightning precision plugin), or None."""
    return COMPUTE_DTYPES.get(precision.precision) if isinstance(precision, MixedPrecision) else None


def shard_model(model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module], plan: ParallelPlan) -> None:
    """``fully_shard`` each block (innermost first) and then ``model``, in place, with the plan's policies."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    pin = mesh.device_type == "cuda"  # pinned host memory needs a CUDA driver
    reduce_dtype = plan.reduce_dtype if plan.param_dtype else None
    mp_policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=pin) if plan.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, offload_policy=offload, reshard_after_forward=plan.reshard_after_forward)
    for block in reversed(blocks):
        fully_shard(block, mp_policy=mp_policy, **kwargs)
    # The root's forward hooks see a step's (batch, batch_idx): autocast casts what the root's own layers compute
    # on, so casting the batch (float targets included) to the compute dtype there would only lose precision.
    fully_shard(model, mp_policy=dataclasses.replace(mp_policy, cast_forward_inputs=False), **kwargs)


def sharded_by_user(owner: str, model: nn.Module, layered: bool) -> list[nn.Module]:
    """The outermost FSDP2 modules of a ``model`` its ``configure_model`` sharded (left as they are); [] if none.

    ``layered``: a pipeline or tensor dimension, whose stages and shards this strategy must make itself.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(f"{owner} shards with FSDP2; the model holds FSDP1 wrappers. Fix: drop them.")
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before children
        if isinstance(module, FSDPModule) and id(module) not in inside:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if found and layered:
        raise ValueError(
            f"{owner}: {type(model).__name__}.configure_model applied fully_shard, but a pipeline or tensor dimension"
            " needs this strategy to split and shard the model itself. Fix: drop fully_shard from configure_model,"
            " or use AccelFSDP."
        )
    return found
