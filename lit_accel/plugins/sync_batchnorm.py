"""A portable synchronised BatchNorm: one all-reduce in forward, one in backward, on any backend.

``torch.nn.SyncBatchNorm`` only runs on CUDA-like devices; :class:`SyncBatchNorm` runs torch's own BatchNorm kernels
with the group's statistics on every device. How it computes, and its numerics: ``docs/strategies.md``, SyncBatchNorm.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

__all__ = ["SyncBatchNorm", "batch_norm_over_group"]


def _all_reduce_sum(tensor: Tensor, group: Any) -> None:
    """The one place the layer communicates (the tests count calls by wrapping this function)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _stats_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # float64 for the tiny (2C+1) reduced tensor, needed for |mean| >> std (docs/strategies.md and
    # test_large_mean_small_std_needs_the_float64_combination); MPS has no float64.
    return compute_dtype if device.type == "mps" else torch.float64


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Tensor.to() costs a dispatch even when there is nothing to convert, and these run on every step.
    return t if t.dtype == dtype else t.to(dtype)


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


class _Stats(NamedTuple):
    """The group's statistics, in the dtype BatchNorm's kernels compute in (``count``: 0-d, float64 off MPS)."""

    mean: Tensor
    var: Tensor
    invstd: Tensor
    count: Tensor
    eps: float


def _sums_around_a_shift(input: Tensor) -> bool:
    """Whether :func:`_local_sums` reads ``input`` with vectorised sums around a shift.

    BatchNorm's CPU statistics kernel runs a scalar loop for float32/float64 in the contiguous ``(N, C, *)`` layout;
    its channels-last, ``(N, C)`` and float16/bfloat16 paths are vectorised. The sums pay off once rows (``*``) hold
    16 values or more and the input 2¹⁶ (below, their dozen extra small ops cost more: ``benchmarks/RESULTS.md``).
    """
    return (
        input.device.type == "cpu"
        and input.dtype in (torch.float32, torch.float64)
        and input.stride(1) >= 16
        and input.numel() >= 1 << 16
        and input.is_contiguous()
    )


def _local_sums(input: Tensor, count: int, compute_dtype: torch.dtype, scratch: Tensor | None) -> Tensor:
    """This rank's ``[Σx, Σx², n]`` in the statistics' dtype, from centred moments (or sums around a shift)."""
    stats_dtype = _stats_dtype(compute_dtype, input.device)
    if count == 0:  # an empty rank still joins the collective, or its peers would wait forever
        return input.new_zeros(2 * input.shape[1] + 1, dtype=stats_dtype)
    if scratch is not None:
        # Shift K = Σx/n (the local mean up to float32 rounding), d = x − K in `scratch`, then Σd and Σd²:
        # Σx = nK + Σd and Σx² = Σd² + K·(2Σd + nK) = Σd² + K·(Σx + Σd), in float64.
        dims = [0, *range(2, input.dim())]
        shift = input.mean(dims)
        d = torch.sub(input, _channel_view(shift, input.dim()), out=scratch)
        sum_d = d.sum(dims).to(stats_dtype)
        sum_d2 = d.square_().sum(dims)
        k = shift.to(stats_dtype)
        sum_x = torch.add(sum_d, k, alpha=count)
        return torch.cat((sum_x, torch.addcmul(sum_d2, k, sum_x + sum_d), sum_x.new_full((1,), count)))
    if input.dtype == compute_dtype:
        mean, var = torch.batch_norm_update_stats(input, None, None, 0.0)
    elif input.device.type in ("cpu", "cuda"):
        # A float16/bfloat16 input with float32 "running" buffers selects the kernel's mixed-precision path (float32
        # accumulation and outputs) without converting the input. The buffers are scratch; momentum 0 leaves them be.
        buffers = torch.zeros(2, input.shape[1], dtype=compute_dtype, device=input.device)
        mean, var = torch.batch_norm_update_stats(input, buffers[0], buffers[1], 0.0)
    else:
        mean, var = torch.batch_norm_update_stats(input.to(compute_dtype), None, None, 0.0)
    m = _cast(mean, stats_dtype)
    # n·[mean, var + mean², 1]; addcmul computes in m's dtype (float64), so mean² is added without float32 rounding.
    return torch.cat((m, torch.addcmul(var, m, m), m.new_ones(1))).mul_(count)


def _global_stats(combined: Tensor, total_count: Tensor, compute_dtype: torch.dtype, eps: float) -> _Stats:
    """The group's statistics from the all-reduced ``[Σx, Σx², N]`` and ``N`` (its last entry)."""
    # Rows: the global mean and E[x²], then (in place) the biased variance E[x²] − mean².
    moments = combined[:-1].view(2, -1).div_(total_count)
    global_mean, global_sq = moments
    global_sq.addcmul_(global_mean, global_mean, value=-1).clamp_min_(0.0)
    mean, var = moments.to(compute_dtype)
    return _Stats(mean, var, torch.rsqrt(var + eps), total_count, eps)


def _normalize(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, stats: _Stats, out: Tensor | None = None
) -> Tensor:
    """``(x − mean)·invstd·weight + bias`` per channel: BatchNorm's element-wise kernel fed these statistics.

    On CPU ``(N, C)`` inputs, where that kernel is a scalar loop, its formula ``x·α + β`` as one broadcast ``addcmul``.
    """
    mean, var, invstd, _, eps = stats
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == mean.dtype:
        alpha = invstd if weight is None else invstd * weight
        beta = torch.mul(mean, alpha).neg_() if bias is None else torch.addcmul(bias, mean, alpha, value=-1)
        return torch.addcmul(beta, x, alpha)
    if out is None:
        return torch.native_batch_norm(x, weight, bias, mean, var, False, 0.0, eps)[0]
    unused = mean.new_empty(0)  # the kernel's saved mean and invstd: none in inference mode
    return torch.ops.aten.native_batch_norm.out(
        x, weight, bias, mean, var, False, 0.0, eps, out=out, save_mean=unused, save_invstd=unused
    )[0]


def _local_grad_sums(grad_output: Tensor, input: Tensor, stats: _Stats) -> tuple[Tensor, Tensor, Tensor]:
    """Local ``Σdy``, the second sum to all-reduce, and ``Σdy·x̂`` (the weight gradient), in the statistics' dtype.

    The second sum is ``Σdy·(x−μ)`` on CUDA (what ``batch_norm_backward_elemt`` takes), else ``Σdy·x̂`` (free there).
    """
    if input.is_cuda:
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
            grad_output, input, stats.mean, stats.invstd, None, True, False, False
        )
        return sum_dy, sum_dy_xmu, sum_dy_xmu * stats.invstd
    # Σdy·x̂ and Σdy are the weight and bias gradients of a BatchNorm with these statistics, whatever its weight. The
    # CPU kernel takes none; other backends' kernels may allocate the weight gradient like the weight, so get one.
    unit_weight = None if input.device.type == "cpu" else torch.ones_like(stats.mean)
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_output, input, unit_weight, None, None, stats.mean, stats.invstd, True, stats.eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat, sum_dy_xhat


def _grad_input(grad_output: Tensor, input: Tensor, weight: Tensor | None, stats: _Stats, sums: Tensor) -> Tensor:
    """``dx = γσ⁻¹·(dy − Σdy/N − x̂·Σdy·x̂/N)`` from the group's sums (see :func:`_local_grad_sums`)."""
    if input.is_cuda:
        sum_dy, sum_dy_xmu = sums
        count = stats.count.to(torch.int32).view(1)
        return torch.batch_norm_backward_elemt(
            grad_output, input, stats.mean, stats.invstd, weight, sum_dy, sum_dy_xmu, count
        )
    # No fused CPU kernel for this: the last two terms are an affine function of x̂, i.e. an inference-mode
    # BatchNorm of x with weight −γσ⁻¹·mean(dy·x̂) and bias −γσ⁻¹·mean(dy) (one element-wise pass, the forward's
    # rounding); one addcmul_ then adds γσ⁻¹·dy in place.
    scale = stats.invstd if weight is None else stats.invstd * weight
    bias_coef, weight_coef = (sums / stats.count).mul_(scale).neg_()
    x, dy = input, grad_output
    if input.dtype != stats.mean.dtype:
        # float16/bfloat16: float32 arithmetic, rounded once at the end. CPU elementwise kernels are several times
        # slower on mixed dtypes than a conversion, so both operands are converted first.
        x, dy = input.to(stats.mean.dtype), grad_output.to(stats.mean.dtype)
    grad_input = _normalize(x, weight_coef, bias_coef, stats)
    grad_input.addcmul_(dy, _channel_view(scale, input.dim()))
    return _cast(grad_input, input.dtype)


def _group_is_empty(total_count: Tensor, input: Tensor) -> bool:
    """Whether no rank holds a sample (nothing to normalise or learn; BatchNorm keeps its running statistics then).

    Raises if the group holds one value per channel. Reads the count on the host, so only a rank holding at most one
    sample calls it (only such a rank can be part of a global count <= 1); every rank of such a group raises.
    """
    global_count = int(total_count.item())
    if global_count == 1:
        raise ValueError(
            "SyncBatchNorm: expected more than 1 value per channel across the process group when training,"
            f" got 1 (this rank's input size {tuple(input.shape)}). Use more samples per step, or put the"
            " layer in eval mode."
        )
    return global_count == 0


def _update_running_stats(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    stats: _Stats,
    total_count: Tensor,
    momentum: float | Tensor,
) -> None:
    """Move the running statistics towards the group's, as plain BatchNorm on the joint batch would."""
    if running_mean is None or running_var is None:
        return
    # Unbiased running variance over the *global* count. `momentum` is a 0-d tensor for momentum=None
    # (1/num_batches_tracked): no host sync.
    unbiased_var = torch.addcdiv(stats.var, stats.var, total_count - 1)  # var·N/(N−1) = var + var/(N−1)
    w = momentum.to(running_mean.dtype) if isinstance(momentum, Tensor) else momentum
    running_mean.lerp_(_cast(stats.mean, running_mean.dtype), w)
    running_var.lerp_(_cast(unbiased_var, running_var.dtype), w)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode BatchNorm over a process group; saves the input, weight and the group's statistics."""

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
        channels = input.shape[1]
        local_count = input.numel() // channels if channels else 0
        # float32 statistics for float16/bfloat16/float32 inputs, float64 for float64 ones (the floating types BatchNorm
        # takes: torch.promote_types(dtype, float32), without its dispatch).
        compute_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
        # With sums around a shift, the output's memory holds x − K until the output is written there.
        out = torch.empty_like(input) if local_count and _sums_around_a_shift(input) else None
        combined = _local_sums(input, local_count, compute_dtype, out)
        _all_reduce_sum(combined, process_group)
        # 0-d: dividing a tensor by it keeps that tensor's dtype (float32 gradients sums, float64 statistics).
        total_count = combined[-1]
        ctx.skip_all = local_count <= 1 and _group_is_empty(total_count, input)
        if ctx.skip_all:
            ctx.save_for_backward(input)
            return torch.empty_like(input)
        stats = _global_stats(combined, total_count, compute_dtype, eps)
        _update_running_stats(running_mean, running_var, stats, total_count, momentum)
        ctx.save_for_backward(input, weight, *stats[:4])
        ctx.eps, ctx.process_group, ctx.local_count = eps, process_group, local_count
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if local_count == 0:
            return torch.empty_like(input)
        w = _cast(weight, compute_dtype) if weight is not None else None
        b = _cast(bias, compute_dtype) if bias is not None else None
        return _normalize(input, w, b, stats, out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        no_grads = (None,) * 5
        if ctx.skip_all:
            (input,) = ctx.saved_tensors
            return (torch.zeros_like(input) if ctx.needs_input_grad[0] else None, None, None, *no_grads)
        input, weight, *tensors = ctx.saved_tensors
        stats = _Stats(*tensors, ctx.eps)
        if ctx.local_count > 0:
            sum_dy, second_sum, sum_dy_xhat = _local_grad_sums(grad_output, input, stats)
        else:
            sum_dy = second_sum = sum_dy_xhat = torch.zeros_like(stats.mean)
        # The local weight and bias gradients (DDP sums them with every other gradient).
        grad_weight = _cast(sum_dy_xhat, weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = _cast(sum_dy, ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = torch.stack((sum_dy, second_sum))
            _all_reduce_sum(sums, ctx.process_group)
            w = _cast(weight, stats.mean.dtype) if weight is not None else None
            grad_input = _grad_input(grad_output, input, w, stats, sums) if ctx.local_count else torch.zeros_like(input)
        return (grad_input, grad_weight, grad_bias, *no_grads)


def batch_norm_over_group(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    momentum: float | Tensor,
    process_group: Any | None,
) -> Tensor:
    """Training-mode ``F.batch_norm`` with the statistics of ``process_group``'s joint batch (one all-reduce each way).

    The running statistics move by ``momentum`` towards the joint batch's (unbiased variance over the global count);
    ``momentum`` may be a 0-d tensor (a cumulative average without a host sync).
    """
    return _SyncBatchNormFunction.apply(input, weight, bias, running_mean, running_var, eps, momentum, process_group)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole process group's batch, on any backend.

    Drop-in for ``torch.nn.SyncBatchNorm`` (same constructor, parameters, buffers and ``state_dict`` keys) that also
    runs on CPU/gloo, with uneven (even empty) per-rank batches and float16/bfloat16 inputs. One ``all_reduce`` in
    forward and one in backward; none in eval mode or without a process group of several ranks (plain BatchNorm then).
    :class:`~lit_accel.plugins.layer_sync.AccelSyncBatchNorm` converts a model's layers to it.

    The layer raises on a *global* count of one value per channel (not a local one): a rank may hold a single sample.
    A rank whose loss does not use this layer's output skips its backward collective and leaves its peers waiting,
    as with ``torch.nn.SyncBatchNorm``.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as ``torch.nn.BatchNorm2d``'s
            (``num_features`` is ``C`` of an ``(N, C, *)`` input; ``momentum=None``: a cumulative moving average).
        process_group: the ranks whose batches are normalised together; ``None`` is the whole world.
        bias: with ``affine``, learn the bias too (``False``: weight only).

    Raises:
        ValueError: in a training forward, if the input has fewer than 2 dimensions, no channels, or the group holds
            only one value per channel.

    Example::

        # every BatchNorm of the model converted to this layer while fitting, and back afterwards
        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[AccelSyncBatchNorm()])
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

    @override
    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` with the group's batch statistics in training, the running ones in eval mode."""
        self._check_input_dim(input)
        # Same rule as torch.nn.SyncBatchNorm: only training-mode forwards communicate.
        distributed = self.training and dist.is_available() and dist.is_initialized()
        if not (distributed and dist.get_world_size(self.process_group) > 1):
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
        return batch_norm_over_group(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, self.process_group
        )

    @override
    def extra_repr(self) -> str:
        group = "world" if self.process_group is None else "sub-group"
        return f"{super().extra_repr()}, process_group={group}"
