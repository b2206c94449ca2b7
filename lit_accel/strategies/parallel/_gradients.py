"""Gradient agreements over the whole mesh: the fp16 found-inf flag and the total norm for clipping.

A stage holds only its own parameters, and under FSDP x TP they are ``DTensor`` shards on different sub-meshes (a norm
layer on the data dimension only, a projection on data x tensor). torch's ``clip_grad_norm_`` stacks per-parameter
norms and fails across meshes, and a stage-local norm misses the other stages (0.166 and 0.280 where the true norm is
0.326). Here each rank sums the squares of its local shards, weighted by how many ranks of its stage hold the same
values, and one all-reduce over the world gives every rank the model's norm.

DTensor's unscale all-reduces found-inf over a parameter's own mesh, which never includes the pipeline dimension: an
overflow in stage 1 alone would let stage 0 step. The flag is all-reduced (max) over the world on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lit_accel.utilities._compat import grad_scaler_found_infs

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["agree_found_inf", "clip_total_norm_", "total_norm"]


def _local_grads(params: list[torch.nn.Parameter], ranks_per_stage: int) -> dict[float, list[Tensor]]:
    """Local gradient tensors grouped by the weight of their squares (shards / ranks holding the stage)."""
    from torch.distributed.tensor import DTensor

    groups: dict[float, list[Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        shards = 1
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise RuntimeError(
                    f"AccelParallel: a gradient with a Partial placement {grad.placements} reached the step."
                )
            shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_shard())
            grad = grad.to_local()
        groups[shards / ranks_per_stage].append(grad)
    return groups


def total_norm(params: list[torch.nn.Parameter], ranks_per_stage: int, device: torch.device) -> Tensor:
    """The 2-norm of the whole model's gradient (every stage, every shard) on every rank: one all-reduce."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for weight, grads in _local_grads(params, ranks_per_stage).items():
        norm = torch.nn.utils.get_total_norm(grads, 2.0).to(device=device, dtype=torch.float32)
        squares = squares + norm.square() * weight
    if dist.is_initialized():
        dist.all_reduce(squares)
    return squares.sqrt()


def clip_total_norm_(
    params: list[torch.nn.Parameter], max_norm: float, ranks_per_stage: int, device: torch.device
) -> Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` as ``clip_grad_norm_`` does; returns the norm."""
    norm = total_norm(params, ranks_per_stage, device)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grads in _local_grads(params, ranks_per_stage).values():
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
    return norm


def agree_found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> None:
    """After ``scaler.unscale_(optimizer)``: every rank's found-inf flag becomes the maximum over the world."""
    if not dist.is_initialized():
        return
    for flag in grad_scaler_found_infs(scaler).get(id(optimizer), []):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
