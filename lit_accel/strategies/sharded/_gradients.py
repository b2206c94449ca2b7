"""Gradient agreements over the whole mesh: one norm of the whole model, for clipping and for skipping.

A stage holds only its own parameters, and under FSDP x TP they are ``DTensor`` shards on different sub-meshes (a norm
layer on the data dimension only, a projection on data x tensor). torch's ``clip_grad_norm_`` stacks per-parameter
norms and fails across meshes, and a stage-local norm misses the other stages (0.166 and 0.280 where the true norm is
0.326). Here each rank sums the squares of its local shards, weighted by how many ranks of its stage hold the same
values, and one all-reduce over the world gives every rank the model's norm.

The same norm agrees on skipping: DTensor's unscale all-reduces found-inf over a parameter's own mesh, which never
includes the pipeline dimension, so an overflow in stage 1 alone would let stage 0 step. The norm is non-finite on
every rank when any gradient anywhere is; then one element of each rank's gradients is made inf (on the device, no
host sync), so the precision plugin's own check (a ``GradScaler``'s unscale, AccelPrecision's guard) skips on every
rank. This works with any plugin, because it runs before the plugin unscales.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["agree_and_clip_", "agreeing_closure", "loss_scale", "take_clipping", "total_norm"]


def _local_grads(params: list[torch.nn.Parameter], ranks_per_stage: int) -> dict[float, list[Tensor]]:
    """Local gradient tensors grouped by the weight of their squares: 1 / (ranks of the stage holding the same values).

    Those are the replicas of a ``DTensor`` on its own mesh (its ``Replicate`` dimensions) times the stage's ranks
    outside that mesh; every kind of shard (FSDP's strided ones included) counts once.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[float, list[Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        copies = ranks_per_stage
        if isinstance(grad, DTensor):
            # FSDP and TP reduce every gradient before the step: a Partial one would be counted wrongly in the norm.
            assert not any(p.is_partial() for p in grad.placements), grad.placements
            mesh = grad.device_mesh
            replicas = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())
            copies = replicas * ranks_per_stage // mesh.size()
            grad = grad.to_local()
        groups[1.0 / copies].append(grad)
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


def agree_and_clip_(
    params: list[torch.nn.Parameter],
    ranks_per_stage: int,
    device: torch.device,
    *,
    scale: Tensor | None,
    max_norm: float | None,
    poison: bool,
) -> Tensor:
    """The model's gradient norm (unscaled); non-finite gradients made so on every rank; clipped to ``max_norm``.

    Args:
        params: this rank's parameters.
        ranks_per_stage: ranks holding one pipeline stage (data x tensor).
        device: where the norm lives.
        scale: the fp16 loss scale the gradients carry (``None``: unscaled); clipping divides it out.
        max_norm: clip to this norm as ``clip_grad_norm_`` does (``None``: no clipping).
        poison: make one element of this rank's gradients inf when the norm is not finite.
    """
    norm = total_norm(params, ranks_per_stage, device)
    if scale is not None:
        norm = norm / scale
    groups = _local_grads(params, ranks_per_stage)
    if poison:
        first = next((grads[0] for grads in groups.values() if grads), None)
        if first is not None:  # adding 0.0 leaves a finite gradient exactly as it was
            first.view(-1)[:1].add_(torch.where(norm.isfinite(), 0.0, float("inf")).to(first.dtype))
    if max_norm is not None:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(coef.to(grad.dtype))
    return norm


def agreeing_closure(
    closure: Callable[[], Any],
    optimizer: Optimizer,
    precision: Any,
    ranks_per_stage: int,
    device: torch.device,
    max_norm: float | None,
    record: Callable[[Tensor], None],
) -> Callable[[], Any]:
    """``closure``, then :func:`agree_and_clip_` over ``optimizer``'s parameters, the norm handed to ``record``.

    Only where needed: fp16 (the plugin's ``scaler``), a plugin that guards non-finite steps (AccelPrecision's
    ``on_nonfinite``), or clipping.
    """
    scaler = getattr(precision, "scaler", None)
    fp16 = scaler is not None and scaler.is_enabled()
    poison = fp16 or getattr(precision, "on_nonfinite", "off") != "off"
    if not poison and max_norm is None:
        return closure

    def run() -> Any:
        result = closure()
        if result is None:  # training_step returned None: no backward, nothing to agree on
            return result
        scale = scaler.scale(torch.ones((), device=device)) if fp16 else None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        record(agree_and_clip_(params, ranks_per_stage, device, scale=scale, max_norm=max_norm, poison=poison))
        return result

    return run


def take_clipping(trainer: pl.Trainer) -> tuple[float, Any] | None:
    """Take norm clipping from the Trainer: ``(value, algorithm)``, or ``None`` where it clips by value or not at all.

    The strategy clips over every stage and mesh dimension; Lightning's would use one stage's shards.
    """
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
        taken = (float(trainer.gradient_clip_val), trainer.gradient_clip_algorithm)
        trainer.gradient_clip_val = None
        return taken
    return None


def loss_scale(precision_plugin: Any, device: torch.device) -> Tensor | None:
    """The fp16 scale as a device tensor, recorded by the scaler on every stage (only the last one scales)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), device=device))
