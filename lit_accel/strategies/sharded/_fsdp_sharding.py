"""How the sharded strategies shard: FSDP2's ``fully_shard`` per block and then on the root, and FSDP's dtypes.

The blocks are ``parts/_blocks.py``'s. They are sharded innermost first, then the root, as torchtitan does;
activation checkpointing wraps the blocks first (``torch.distributed._composable.checkpoint``: no module or key
changes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lit_accel.utilities._compat import composable_checkpoint

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mixed_precision_policy", "shard_model"]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module],
    *,
    reshard_after_forward: bool,
    mp_policy: Any,
    offload_policy: Any,
    checkpointed: list[nn.Module],
) -> None:
    """Checkpoint ``checkpointed``, then ``fully_shard`` each block (innermost first) and the root, in place."""
    from torch.distributed.fsdp import fully_shard

    checkpoint = composable_checkpoint()
    for module in checkpointed:
        checkpoint(module)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for block in reversed(blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's forward hooks see a step's (batch, batch_idx): autocast casts what the root's own layers compute
    # on, so casting the batch (float targets included) to the compute dtype there would only lose precision.
    kwargs["mp_policy"] = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def mixed_precision_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> Any:
    """FSDP2's policy: parameters cast to ``param_dtype`` for compute, gradients reduced in ``reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
