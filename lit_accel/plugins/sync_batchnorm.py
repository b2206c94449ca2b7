"""A portable synchronised BatchNorm: one all-reduce in forward, one in backward, on any backend.

``torch.nn.SyncBatchNorm`` only runs on CUDA-like devices: on CPU/gloo the DDP constructor rejects it ("SyncBatchNorm
layers only work with GPU modules"), its forward refuses CPU tensors and ``torch.batch_norm_stats`` has no CPU kernel.
:class:`SyncBatchNorm` here is built from ops every backend has:

* **forward** — each rank computes its local per-channel mean and biased variance with
  ``torch.batch_norm_update_stats`` (plain BatchNorm's statistics kernel: centred, two-pass with a float64 accumulator
  on CPU, Welford on CUDA), turns them into sums ``[Σx, Σx², n]`` and all-reduces that one ``2C+1`` tensor over the
  layer's process group. The output is then ``F.batch_norm`` in inference mode with the *global* mean and variance,
  so the element-wise arithmetic is exactly plain BatchNorm's.
* **backward** — the two per-channel reductions the input gradient needs, ``Σdy`` and ``Σdy·x̂``, come from
  ``native_batch_norm_backward`` with only its weight/bias outputs requested; they are all-reduced as one ``2C``
  tensor and the input gradient is the standard BatchNorm backward (Ioffe & Szegedy 2015, §3) with global sums:
  ``dx = γ·σ⁻¹·(dy − Σdy/N − x̂·Σ(dy·x̂)/N)``. The weight and bias gradients stay local, as in
  ``torch.nn.SyncBatchNorm``: DDP's gradient all-reduce combines them like every other parameter's.

Numerical care: the combined sums are formed and reduced in **float64** (``2C+1`` numbers, so the extra bytes do not
matter), because ``E[x²] − E[x]²`` in float32 loses everything when ``|mean| ≫ std`` (about ``2⁻²⁴·mean²`` of absolute
error: with mean 1e3 and std 1 that is several percent of the variance). Each rank's local moments are centred (the
kernel's two-pass algorithm), so the only cancellation left is the float64 one, good to ``|mean|/std`` around 1e5 —
well beyond what a float32 input can carry. On devices without float64 (MPS) the reduction falls back to float32 and
that limit drops to ``|mean|/std`` around 1e2. Statistics are float32 for float16/bfloat16 inputs (autocast or
``-true`` precision); the output has the input's dtype.

Only training-mode forwards communicate. In eval mode the layer uses its running statistics (or, with
``track_running_stats=False``, the local batch statistics), the same rule as ``torch.nn.SyncBatchNorm``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

__all__ = ["SyncBatchNorm"]


def _all_reduce_sum(tensor: Tensor, group: Any) -> None:
    """The one place the layer communicates (the tests count calls by wrapping this function)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _stats_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # float64 for the tiny reduced tensor (see the module docstring); MPS has no float64.
    return compute_dtype if device.type == "mps" else torch.float64


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode BatchNorm over a process group; saves only the input, weight, mean, var, invstd and count."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float | Tensor,
        process_group: Any,
    ) -> Tensor:
        num_channels = input.shape[1]
        local_count = input.numel() // num_channels if num_channels else 0
        # float32 statistics for float16/bfloat16 inputs, float64 for float64 inputs.
        compute_dtype = torch.promote_types(input.dtype, torch.float32)
        stats_dtype = _stats_dtype(compute_dtype, input.device)

        # Local sums [Σx, Σx², n] from centred local moments, so the float32 part never cancels.
        if local_count > 0:
            local_mean, local_var = torch.batch_norm_update_stats(input.to(compute_dtype), None, None, 0.0)
            local_mean, local_var = local_mean.to(stats_dtype), local_var.to(stats_dtype)
            count = input.new_full((1,), local_count, dtype=stats_dtype)
            combined = torch.cat([local_mean * local_count, (local_var + local_mean * local_mean) * local_count, count])
        else:
            # An empty rank still joins the collective, or its peers would wait forever.
            combined = input.new_zeros(2 * num_channels + 1, dtype=stats_dtype)
        _all_reduce_sum(combined, process_group)
        total_sum, total_sq_sum, total_count = combined.split([num_channels, num_channels, 1])

        if local_count <= 1:
            # Only a rank holding at most one sample can be part of a global count <= 1, so only such a rank pays this
            # host read; ranks with more samples skip it. Every rank of a group with a global count of 1 raises here.
            global_count = int(total_count.item())
            if global_count == 1:
                raise ValueError(
                    "SyncBatchNorm: expected more than 1 value per channel across the process group when training,"
                    f" got 1 (this rank's input size {tuple(input.shape)}). Use more samples per step, or put the"
                    " layer in eval mode."
                )
            if global_count == 0:
                # Every rank of the group was empty: nothing to normalise and nothing to learn (plain BatchNorm
                # leaves its running statistics alone on an empty batch too).
                ctx.skip_all = True
                ctx.save_for_backward(input)
                return torch.empty_like(input)
        ctx.skip_all = False

        mean = total_sum / total_count
        var = (total_sq_sum / total_count - mean * mean).clamp_min_(0.0)
        if running_mean is not None and running_var is not None:
            # Unbiased running variance over the *global* count, as plain BatchNorm on the joint batch would keep.
            # `momentum` is a 0-d tensor for momentum=None (1/num_batches_tracked): no host sync.
            unbiased_var = var * (total_count / (total_count - 1))
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
            running_var.mul_(1 - momentum).add_((unbiased_var * momentum).to(running_var.dtype))

        mean, var = mean.to(compute_dtype), var.to(compute_dtype)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(input, weight, mean, var, invstd, total_count.to(compute_dtype))
        ctx.eps = eps
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.process_group = process_group
        ctx.local_count = local_count
        if local_count == 0:
            return torch.empty_like(input)
        # Plain BatchNorm's element-wise kernel with the global statistics as its "running" ones.
        w = weight.to(compute_dtype) if weight is not None else None
        b = bias.to(compute_dtype) if bias is not None else None
        return F.batch_norm(input, mean, var, w, b, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        no_grads = (None,) * 5
        if ctx.skip_all:
            (input,) = ctx.saved_tensors
            return (torch.zeros_like(input) if ctx.needs_input_grad[0] else None, None, None, *no_grads)
        input, weight, mean, var, invstd, total_count = ctx.saved_tensors
        num_channels = input.shape[1]
        if ctx.local_count > 0:
            # Σdy·x̂ and Σdy are exactly the weight and bias gradients of a unit-weight BatchNorm. The unit weight is
            # passed explicitly: torch's CUDA kernel allocates its weight gradient from the weight's options and fails
            # on a missing weight (the CPU kernel accepts None). In the statistics dtype it selects the kernel's
            # mixed-precision path (float32 accumulation) for float16/bfloat16 inputs.
            unit_weight = torch.ones(num_channels, dtype=mean.dtype, device=mean.device)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, input, unit_weight, None, None, mean, invstd, True, ctx.eps, [False, True, True]
            )
        else:
            sum_dy_xhat = sum_dy = mean.new_zeros(num_channels)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None

        grad_input = None
        if ctx.needs_input_grad[0]:
            combined = torch.cat([sum_dy, sum_dy_xhat])
            _all_reduce_sum(combined, ctx.process_group)
            if ctx.local_count == 0:
                grad_input = torch.zeros_like(input)
            else:
                mean_dy, mean_dy_xhat = (combined / total_count).split(num_channels)
                scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
                # dx = γσ⁻¹·dy − γσ⁻¹·mean(dy) − γσ⁻¹·mean(dy·x̂)·x̂. The last two terms are an affine function of x̂,
                # i.e. an inference-mode BatchNorm of x with weight −γσ⁻¹·mean(dy·x̂) and bias −γσ⁻¹·mean(dy): one
                # pass of the native kernel instead of three elementwise passes (x − μ, scale, shift), with the same
                # rounding as the forward's output.
                grad_input = F.batch_norm(
                    input.to(mean.dtype), mean, var, -scale * mean_dy_xhat, -scale * mean_dy, False, 0.0, ctx.eps
                )
                grad_input.addcmul_(grad_output, _channel_view(scale, input.dim()))
                grad_input = grad_input.to(input.dtype)
        return (grad_input, grad_weight, grad_bias, *no_grads)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole process group's batch, on any backend.

    Drop-in for ``torch.nn.SyncBatchNorm`` (same constructor, same parameters, buffers and ``state_dict`` keys) that
    also runs on CPU/gloo, accepts any input BatchNorm1d/2d/3d accepts, ranks with different (even zero) batch
    sizes, and float16/bfloat16 inputs (statistics in float32). One ``all_reduce`` in forward and one in backward;
    none in eval mode, and none when the group has a single rank or ``torch.distributed`` is not initialised (then it
    is plain BatchNorm). Prefer :class:`~lit_accel.plugins.layer_sync.AccelSyncBatchNorm`, which converts a model's
    layers and picks torch's fused CUDA kernels where they apply.

    The layer raises on a *global* count of one value per channel (not a local one): a rank may hold a single sample.
    A rank whose loss does not use this layer's output skips its backward collective and leaves its peers waiting,
    as with ``torch.nn.SyncBatchNorm``.

    Args:
        num_features: number of channels ``C`` of an input of shape ``(N, C, *)``.
        eps: added to the variance for numerical stability.
        momentum: running-statistics update factor; ``None`` for a cumulative moving average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean/variance (used in eval mode); ``False`` uses batch statistics always.
        process_group: the ranks whose batches are normalised together; ``None`` is the whole world.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        bias: with ``affine``, learn the bias too (``False``: weight only).

    Raises:
        ValueError: in a training forward, if the input has fewer than 2 dimensions, no channels, or the group holds
            only one value per channel.

    Example::

        import lightning.pytorch as pl
        from lit_accel.plugins.layer_sync import AccelSyncBatchNorm

        # converts every BatchNorm of the model to this layer while fitting, and back afterwards
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[AccelSyncBatchNorm()])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if not bias:  # set here rather than passed on: older torch releases' _BatchNorm has no `bias` argument
            self.register_parameter("bias", None)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of shape (N, C, *), got {input.dim()}D input.")
        if input.shape[1] == 0:
            raise ValueError("SyncBatchNorm: the input has no channels (shape[1] == 0).")

    def _needs_sync(self) -> bool:
        # Same rule as torch.nn.SyncBatchNorm: only training-mode forwards communicate.
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1

    @override
    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` with the group's batch statistics in training, the running ones in eval mode."""
        self._check_input_dim(input)
        if not self._needs_sync():
            return super().forward(input)

        momentum: float | Tensor = 0.0 if self.momentum is None else self.momentum
        running_mean = running_var = None
        if self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            running_mean, running_var = self.running_mean, self.running_var
            if self.momentum is None:
                # Cumulative moving average as a device tensor, so no host sync (torch reads the count on the host).
                momentum = 1.0 / self.num_batches_tracked
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, self.process_group
        )

    @override
    def extra_repr(self) -> str:
        group = "world" if self.process_group is None else "sub-group"
        return f"{super().extra_repr()}, process_group={group}"
