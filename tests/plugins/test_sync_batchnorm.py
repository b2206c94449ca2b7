"""The portable SyncBatchNorm equals plain BatchNorm on the joint batch, in real multi-process gloo groups."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lit_accel.plugins.sync_batchnorm as sbn
from lit_accel.plugins.sync_batchnorm import SyncBatchNorm
from tests.helpers import run_distributed
from tests.helpers.torch_features import batchnorm

_BN_BY_NDIM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def make_portable(group: Any = None) -> Callable[[nn.Module], nn.Module]:
    """A factory turning a reference BatchNorm into a portable SyncBatchNorm with the same state."""

    def make(ref: nn.Module) -> nn.Module:
        sync = SyncBatchNorm(
            ref.num_features,
            ref.eps,
            ref.momentum,
            ref.affine,
            ref.track_running_stats,
            process_group=group,
            bias=ref.bias is not None,
        )
        sync.load_state_dict(ref.state_dict())
        return sync

    return make


def check_joint_batch_equivalence(
    rank: int,
    sizes: Sequence[int],
    feature_shape: Sequence[int],
    make_sync: Callable[[nn.Module], nn.Module],
    group_ranks: Sequence[int] | None = None,
    group: Any = None,
    affine: bool = True,
    bias: bool = True,
    momentum: float | None = 0.1,
    track: bool = True,
    steps: int = 3,
    seed: int = 0,
    channels_last: bool = False,
    tol: float = 1e-5,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Run ``steps`` training steps and compare with BatchNorm on the joint batch of ``group_ranks``.

    ``sizes`` are the per-rank batch sizes of the whole world; every rank draws the same global batch from ``seed`` and
    takes its rows. Outputs, input gradients, the group-summed weight/bias gradients, the running statistics, and the
    eval-mode output (no communication) must match the reference ``_BatchNorm`` applied to the group's rows.
    """
    group_ranks = list(range(len(sizes))) if group_ranks is None else list(group_ranks)
    num_channels = feature_shape[0]
    offsets = [0, *itertools.accumulate(sizes)]
    lo, hi = offsets[rank], offsets[rank + 1]
    glo, ghi = offsets[group_ranks[0]], offsets[group_ranks[-1] + 1]
    gen = torch.Generator().manual_seed(seed)

    ref = batchnorm(
        _BN_BY_NDIM[len(feature_shape) + 1],
        num_channels,
        momentum=momentum,
        affine=affine,
        track_running_stats=track,
        bias=bias,
    )
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.rand(num_channels, generator=gen) + 0.5)
            if bias:
                ref.bias.copy_(torch.randn(num_channels, generator=gen))
    ref.to(dtype)
    sync = make_sync(copy.deepcopy(ref)).to(dtype)
    channel_scale = torch.rand(num_channels, generator=gen).view(1, -1, *([1] * (len(feature_shape) - 1))) * 3 + 0.2
    tag = f"rank {rank}, sizes {list(sizes)}, shape {tuple(feature_shape)}, affine={affine}, momentum={momentum}"
    tag += f", track={track}, channels_last={channels_last}, bias={bias}, {dtype}"

    for step in range(steps):
        inputs = (torch.randn(offsets[-1], *feature_shape, generator=gen) * channel_scale + 0.5).to(dtype)
        upstream = torch.randn(offsets[-1], *feature_shape, generator=gen).to(dtype)
        x_ref = inputs[glo:ghi].clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * upstream[glo:ghi]).sum().backward()
        x = inputs[lo:hi].clone()
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        y = sync(x)
        (y * upstream[lo:hi]).sum().backward()
        where = f"{tag}, step {step}"
        assert_close(y, y_ref[lo - glo : hi - glo], f"{where}: output", tol)
        assert_close(x.grad, x_ref.grad[lo - glo : hi - glo], f"{where}: input grad", tol)
        if affine:
            grads = torch.cat([p.grad for p in sync.parameters()])
            dist.all_reduce(grads, group=group)  # the test's own sum over the group: DDP's job in training
            ref_grads = torch.cat([p.grad for p in ref.parameters()])
            assert_close(grads, ref_grads, f"{where}: weight/bias grads", tol)
            for module in (ref, sync):
                module.zero_grad()
    if track:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_close(getattr(sync, name), getattr(ref, name), f"{tag}: {name}", tol)
    # Eval mode: running statistics (or local batch statistics without them), no collective. Only a local batch
    # with more than one value per channel can be normalised alone.
    if track or (hi - lo) * (inputs[0, 0].numel()) > 1:
        sync.eval()
        ref.eval()
        with torch.no_grad():
            assert_close(sync(inputs[lo:hi]), ref(inputs[lo:hi]), f"{tag}: eval output", tol)


# ---------------------------------------------------------------------------------------------------------------------
# Equivalence with BatchNorm on the joint batch


_SHAPES = [(4,), (3, 5), (4, 3, 2), (2, 3, 2, 2)]  # (C, *spatial): BatchNorm1d (N,C), (N,C,L), 2d, 3d


def _many_configurations(rank: int, world_size: int) -> int:
    checked = 0
    for shape, sizes, affine, momentum, track in itertools.product(
        _SHAPES, [(3, 5), (1, 4)], [True, False], [0.1, None], [True, False]
    ):
        check_joint_batch_equivalence(
            rank, sizes, shape, make_portable(), affine=affine, momentum=momentum, track=track, seed=checked
        )
        checked += 1
    # channels_last input, and two single-sample ranks: only the *global* count must exceed one.
    check_joint_batch_equivalence(rank, (3, 5), (4, 3, 2), make_portable(), channels_last=True, seed=checked)
    check_joint_batch_equivalence(rank, (1, 1), (4,), make_portable(), momentum=None, seed=checked + 1)
    check_joint_batch_equivalence(rank, (3, 5), (4, 3, 2), make_portable(), bias=False, seed=checked + 2)
    # float64 layers: statistics and arithmetic in float64 (BatchNorm's kernels; the sums around a shift for large
    # inputs: test_large_inputs_read_with_sums_around_a_shift_match_the_joint_batch).
    for seed, shape in enumerate([(4, 3, 2), (4,)], start=checked + 3):
        check_joint_batch_equivalence(rank, (3, 5), shape, make_portable(), dtype=torch.float64, tol=1e-12, seed=seed)
    return checked + 5


def test_matches_batchnorm_on_the_joint_batch_in_every_configuration():
    """BatchNorm1d/2d/3d x uneven sizes (3+5, 1+4) x affine x momentum (0.1, None) x running stats, 3 steps each;
    plus channels_last, one sample per rank, an affine layer without bias, and float64 layers."""
    assert run_distributed(_many_configurations, 2) == [69, 69]


def _large_inputs(rank: int, world_size: int) -> list[bool]:
    # (per-rank sizes, per-sample shape, dtype, tolerance): contiguous inputs above the size from which the layer reads
    # its statistics with sums around a shift; where a rank holds fewer values it uses BatchNorm's kernel, so ranks on
    # different paths are combined too.
    cases = [
        ((5, 3), (16, 32, 32), torch.float32, 1e-5),
        ((4, 6), (8, 4, 32, 32), torch.float64, 1e-12),
        ((6, 2), (16, 1024), torch.float32, 1e-5),
    ]
    paths = []
    for seed, (sizes, shape, dtype, tol) in enumerate(cases):
        paths.append(sbn._sums_around_a_shift(torch.empty(sizes[rank], *shape, dtype=dtype)))
        affine, momentum, track = seed != 1, (0.1, None, 0.1)[seed], seed != 2
        check_joint_batch_equivalence(
            rank, sizes, shape, make_portable(), affine=affine, momentum=momentum, track=track, steps=2, seed=seed,
            dtype=dtype, tol=tol,
        )  # fmt: skip
    return paths


def test_large_inputs_read_with_sums_around_a_shift_match_the_joint_batch():
    """BatchNorm1d/2d/3d inputs above the shifted-sums threshold (float32 and float64), ranks on either path."""
    assert run_distributed(_large_inputs, 2) == [[True, True, True], [False, True, False]]


def _edge_cases(rank: int, world_size: int) -> None:
    # A rank without samples still joins both collectives; the other rank gets BatchNorm over its own batch.
    for seed, shape in enumerate(_SHAPES):
        check_joint_batch_equivalence(rank, (0, 4), shape, make_portable(), seed=seed)

    # One value per channel in the whole group: every rank raises (after the collective, so nobody hangs).
    layer = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"expected more than 1 value per channel across the process group.*got 1"):
        layer(torch.randn(1 - rank, 3))

    # An empty batch on every rank: empty output, running statistics untouched, backward runs.
    layer = SyncBatchNorm(3)
    x = torch.randn(0, 3, 2, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(layer.running_mean, torch.zeros(3), rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, torch.ones(3), rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"SyncBatchNorm: expected an input of shape \(N, C, \*\), got 1D input"):
        layer(torch.randn(3))


def test_empty_ranks_single_samples_and_bad_inputs():
    run_distributed(_edge_cases, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Communication: one collective per layer in forward, one in backward, none in eval mode


def _count_collectives(rank: int, world_size: int) -> list[int]:
    sizes: list[int] = []
    real = sbn._all_reduce_sum

    def counting(tensor: torch.Tensor, group: Any) -> None:
        sizes.append(tensor.numel())
        real(tensor, group)  # the real collective still runs

    sbn._all_reduce_sum = counting
    model = nn.Sequential(nn.Conv2d(2, 4, 1), SyncBatchNorm(4), nn.ReLU(), nn.Conv2d(4, 3, 1), SyncBatchNorm(3))
    out = model(torch.randn(3 + rank, 2, 5, 5))
    forward_sizes = list(sizes)
    out.square().sum().backward()
    backward_sizes = sizes[len(forward_sizes) :]

    # Eval mode on rank 0 only: a collective would hang (the harness would time out), and none is counted.
    no_stats = SyncBatchNorm(4, track_running_stats=False).eval()
    if rank == 0:
        model.eval()
        x = torch.randn(2, 2, 5, 5)
        model(x)
        local = torch.randn(5, 4, 3)
        torch.testing.assert_close(no_stats(local), nn.functional.batch_norm(local, None, None, training=True))
    dist.barrier()
    sbn._all_reduce_sum = real
    return [*forward_sizes, -1, *backward_sizes, -1, *sizes[len(forward_sizes) + len(backward_sizes) :]]


def test_one_fused_all_reduce_per_layer_in_forward_and_backward_none_in_eval():
    # forward: [Σx, Σx², n] = 2C+1 numbers per layer; backward (reverse order): [Σdy, Σdy·x̂] = 2C; eval: nothing.
    assert run_distributed(_count_collectives, 2, timeout=30) == [[9, 7, -1, 6, 8, -1]] * 2


def _ddp_step(rank: int, world_size: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    synced = copy.deepcopy(plain)
    synced[1] = make_portable()(plain[1])
    ddp = DistributedDataParallel(synced)  # torch's SyncBatchNorm would raise here on CPU
    inputs, upstream = torch.randn(8, 5), torch.randn(8, 2)
    lo, hi = (0, 3) if rank == 0 else (3, 8)
    (ddp(inputs[lo:hi]) * upstream[lo:hi]).sum().backward()
    # DDP averages the ranks' gradients of their own losses: (1/W) d(Σ losses)/dθ.
    ((plain(inputs) * upstream).sum() / world_size).backward()
    for (name, p), q in zip(synced.named_parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, f"rank {rank}: grad of {name}", 1e-5)


def test_distributed_data_parallel_accepts_the_layer_on_gloo_and_gets_the_joint_batch_gradients():
    run_distributed(_ddp_step, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Precision


def _autocast(rank: int, world_size: int) -> None:
    sizes, shape = (3, 5), (4, 3, 3)
    lo, hi = (0, 3) if rank == 0 else (3, 8)
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(1)
        # Values representable in the low-precision dtype, so the fp32 reference sees exactly the same numbers.
        inputs = (torch.randn(sum(sizes), *shape, generator=gen) * 2 + 1).to(dtype)
        upstream = torch.randn(sum(sizes), *shape, generator=gen).to(dtype).float()
        ref = nn.BatchNorm2d(4)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
        sync = make_portable()(ref)
        x_ref = inputs.float().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * upstream).sum().backward()

        x = inputs[lo:hi].clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            y = sync(x)
        (y.float() * upstream[lo:hi]).sum().backward()

        eps = torch.finfo(dtype).eps
        assert y.dtype == dtype and x.grad.dtype == dtype and sync.weight.grad.dtype == torch.float32
        # fp32 statistics: a low-precision reduction would be off by ~eps(dtype), far above 1e-5.
        assert_close(sync.running_mean, ref.running_mean, f"{dtype} running_mean", 1e-5)
        assert_close(sync.running_var, ref.running_var, f"{dtype} running_var", 1e-5)
        # The fp32 result rounded once to the dtype: within half an ulp, |error| <= eps/2 * |value|.
        torch.testing.assert_close(y.float(), y_ref[lo:hi], rtol=eps, atol=eps)
        grad_scale = x_ref.grad.abs().max().item()
        torch.testing.assert_close(x.grad.float(), x_ref.grad[lo:hi], rtol=eps, atol=eps * grad_scale)
        grads = torch.cat([sync.weight.grad, sync.bias.grad])
        dist.all_reduce(grads)
        assert_close(grads, torch.cat([ref.weight.grad, ref.bias.grad]), f"{dtype} weight/bias grads", 1e-4)


def test_autocast_bf16_and_fp16_use_fp32_statistics_and_keep_the_input_dtype():
    run_distributed(_autocast, 2)


# Per-sample shapes of the large-mean tests: BatchNorm's statistics kernel reads the small one, the sums around a shift
# the large one (more than 2**16 values per rank, rows of 64 x 64).
_LARGE_MEAN_SHAPES = pytest.mark.parametrize("shape", [(3, 4, 4), (3, 64, 64)], ids=["kernel", "shifted_sums"])


def _large_mean(rank: int, world_size: int, shape: tuple[int, ...]) -> None:
    """Input mean 1e3, std 1: float32 E[x²]-E[x]² would lose the variance; compare with float64 BatchNorm."""
    sizes, mean, std = (6, 10), 1e3, 1.0
    assert sbn._sums_around_a_shift(torch.empty(sizes[rank], *shape)) == (shape[-1] > 4)
    lo, hi = (0, 6) if rank == 0 else (6, 16)
    gen = torch.Generator().manual_seed(2)
    inputs = (torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64) * std + mean).float()
    upstream = torch.randn(sum(sizes), *shape, generator=gen)
    ref = nn.BatchNorm2d(3, momentum=None).double()
    sync = SyncBatchNorm(3, momentum=None)
    x_ref = inputs.double().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * upstream.double()).sum().backward()
    x = inputs[lo:hi].clone().requires_grad_()
    y = sync(x)
    (y * upstream[lo:hi]).sum().backward()

    # A float32 value near the mean is only known to about eps32·|mean| (its ulp): no float32 BatchNorm can do better
    # than that relative to the std. Allow a few of those.
    eps32 = torch.finfo(torch.float32).eps
    tol = 4 * eps32 * mean / std
    assert_close(y.double(), y_ref[lo:hi].detach(), "output", tol)
    assert_close(x.grad.double(), x_ref.grad[lo:hi], "input grad", tol)
    assert_close(sync.running_var.double(), ref.running_var, "running_var", tol)
    torch.testing.assert_close(sync.running_mean.double(), ref.running_mean, rtol=4 * eps32, atol=0)

    # The test can fail: float32 E[x²]-E[x]² on the same data misses the variance by far more than the tolerance.
    dims = (0, 2, 3)
    naive_var = inputs.square().mean(dim=dims) - inputs.mean(dim=dims).square()
    true_var = inputs.double().var(dim=dims, unbiased=False)
    assert (naive_var.double() - true_var).abs().max() > 10 * tol


@_LARGE_MEAN_SHAPES
def test_large_mean_small_std_matches_float64_batchnorm(shape):
    run_distributed(_large_mean, 2, shape)


# ---------------------------------------------------------------------------------------------------------------------
# No process group: plain BatchNorm, no collective


def test_without_distributed_it_is_plain_batchnorm_and_never_communicates(monkeypatch: pytest.MonkeyPatch):
    assert not dist.is_initialized()
    calls: list[int] = []
    monkeypatch.setattr(sbn, "_all_reduce_sum", lambda tensor, group: calls.append(tensor.numel()))
    ref = nn.BatchNorm2d(3, momentum=None)
    sync = make_portable()(ref)
    for _ in range(3):
        x = torch.randn(4, 3, 2, 2) * 3 + 1
        x_ref = x.clone().requires_grad_()
        x_sync = x.clone().requires_grad_()
        assert_close(sync(x_sync), ref(x_ref), "output", 1e-6)
        ref(x_ref.detach())  # one more reference step: keep the two in step below
        sync(x_sync.detach())
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(sync, name), getattr(ref, name), name, 1e-6)
    assert calls == []
    assert "process_group=world" in repr(sync)


def _large_mean_errors(rank: int, world_size: int, shape: tuple[int, ...]) -> dict[str, float]:
    """The data of ``_large_mean``: errors of the output and running variance over that test's tolerance, with the
    statistics combined in float64 (the layer) and in float32 (``_stats_dtype`` replaced)."""
    sizes, mean, std = (6, 10), 1e3, 1.0
    lo, hi = (0, 6) if rank == 0 else (6, 16)
    gen = torch.Generator().manual_seed(2)
    inputs = (torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64) * std + mean).float()
    ref = nn.BatchNorm2d(3, momentum=None).double()
    y_ref = ref(inputs.double())
    tol = 4 * torch.finfo(torch.float32).eps * mean / std
    errors = {}
    real = sbn._stats_dtype
    for name, stats_dtype in (("float64", real), ("float32", lambda compute_dtype, device: compute_dtype)):
        sbn._stats_dtype = stats_dtype
        sync = SyncBatchNorm(3, momentum=None)
        y = sync(inputs[lo:hi])
        errors[f"{name} output"] = (y.double() - y_ref[lo:hi]).abs().max().item() / tol
        errors[f"{name} running_var"] = (sync.running_var.double() - ref.running_var).abs().max().item() / tol
    sbn._stats_dtype = real
    return errors


@_LARGE_MEAN_SHAPES
def test_large_mean_small_std_needs_the_float64_combination(shape):
    # Why the 2C+1 statistics are combined in float64: in float32, E[x²] − E[x]² misses the tolerance of
    # test_large_mean_small_std_matches_float64_batchnorm many times over; in float64 it is within it.
    for errors in run_distributed(_large_mean_errors, 2, shape):
        assert errors["float64 output"] <= 1 and errors["float64 running_var"] <= 1, errors
        assert errors["float32 output"] > 10 and errors["float32 running_var"] > 10, errors


# ---------------------------------------------------------------------------------------------------------------------
# The native kernels' layouts and dtypes: channels-last without copies, float16/bfloat16 inputs, BatchNorm1d


# Ops that copy a tensor; none may touch one of the input's size (checked through the profiler's recorded shapes).
# aten::to is not one: it records an event even when it returns its input; a real conversion is an aten::_to_copy.
_COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"}
_FORMATS = {"contiguous": torch.contiguous_format, "cl": torch.channels_last, "cl3d": torch.channels_last_3d}
# (C, *spatial), memory format, dtype. C = 37 and 20 exercise the kernels' vector loops over channels and their tails.
_LAYOUT_CASES = [
    ((37,), "contiguous", torch.float32),  # BatchNorm1d on (N, C)
    ((19, 13), "contiguous", torch.float32),  # BatchNorm1d on (N, C, L)
    ((20, 5, 7), "contiguous", torch.float32),
    ((20, 5, 7), "cl", torch.float32),
    ((6, 3, 4, 5), "cl3d", torch.float32),
    ((37,), "contiguous", torch.bfloat16),
    ((19, 13), "contiguous", torch.float16),
    ((20, 5, 7), "cl", torch.bfloat16),
]


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _full_size_copies(prof: Any, shape: Sequence[int]) -> list[str]:
    return [e.key for e in prof.events() if e.key in _COPY_OPS and list(shape) in [list(s) for s in e.input_shapes]]


def _layouts_and_dtypes(rank: int, world_size: int, device_type: str = "cpu") -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device_type, 0 if device_type == "cuda" else None)
    # CUDA: the reference is cuDNN's BatchNorm, whose float32 rounding differs a little more from the native kernels.
    tol = 1e-4 if device_type == "cuda" else 1e-5
    sizes = (5, 7)
    lo, hi = (0, 5) if rank == 0 else (5, 12)
    ops_seen: set[str] = set()
    for seed, (feature_shape, fmt_name, dtype) in enumerate(_LAYOUT_CASES):
        fmt, num_channels = _FORMATS[fmt_name], feature_shape[0]
        where = f"rank {rank}, shape {feature_shape}, {fmt_name}, {dtype}, {device_type}"
        gen = torch.Generator().manual_seed(seed)
        # Values representable in `dtype`, so that the float32 reference sees the same numbers.
        scale = torch.rand(num_channels, generator=gen).view(1, -1, *([1] * (len(feature_shape) - 1))) * 3 + 0.2
        inputs = (torch.randn(sum(sizes), *feature_shape, generator=gen) * scale + 0.5).to(dtype).float().to(device)
        upstream = torch.randn(sum(sizes), *feature_shape, generator=gen).to(dtype).float().to(device)
        ref = _BN_BY_NDIM[len(feature_shape) + 1](num_channels)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5, generator=gen)
            ref.bias.uniform_(-1, 1, generator=gen)
        sync = make_portable()(ref).to(device)
        ref.to(device)
        x_ref = inputs.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * upstream).sum().backward()
        y_ref = y_ref[lo:hi].detach()

        x = inputs[lo:hi].to(dtype).contiguous(memory_format=fmt).requires_grad_()
        dy = upstream[lo:hi].to(dtype).contiguous(memory_format=fmt)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as forward:
            y = sync(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as backward:
            y.backward(dy)
        ops_seen |= {e.key for e in (*forward.events(), *backward.events())}
        # The input is read where it lies: no copy in forward; in backward only float16/bfloat16 on CPU are
        # converted (float32 arithmetic, see _grad_input).
        assert _full_size_copies(forward, x.shape) == [], where
        if dtype == torch.float32 or device_type == "cuda":
            assert _full_size_copies(backward, x.shape) == [], where
        assert y.dtype == dtype and y.is_contiguous(memory_format=fmt), where
        assert x.grad.dtype == dtype and x.grad.is_contiguous(memory_format=fmt), where

        grads = torch.cat([sync.weight.grad, sync.bias.grad])
        dist.all_reduce(grads)
        if dtype == torch.float32:
            assert_close(y, y_ref, f"{where}: output", tol)
            assert_close(x.grad, x_ref.grad[lo:hi], f"{where}: input grad", tol)
        else:
            # float32 statistics and arithmetic, rounded once to the dtype (as test_autocast_...).
            eps = torch.finfo(dtype).eps
            _assert_within(y.float(), y_ref, f"{where}: output", rtol=eps, atol=eps)
            grad_scale = x_ref.grad.abs().max().item()
            _assert_within(x.grad.float(), x_ref.grad[lo:hi], f"{where}: input grad", rtol=eps, atol=eps * grad_scale)
        assert_close(grads, torch.cat([ref.weight.grad, ref.bias.grad]), f"{where}: weight/bias grads", 1e-4)
        for name in ("running_mean", "running_var"):
            assert_close(getattr(sync, name), getattr(ref, name), f"{where}: {name}", tol)
    return sorted(op for op in ops_seen if op.startswith("aten::batch_norm") or op.startswith("aten::native_batch"))


def test_channels_last_low_precision_and_batchnorm1d_inputs_match_the_joint_batch_without_copies():
    """BatchNorm1d (N, C) and (N, C, L), 2-D and 3-D channels-last, bfloat16/float16 inputs of a float32 layer:
    output and input gradient in the input's dtype and memory format, equal to BatchNorm on the joint batch, and no
    op copies a tensor of the input's size (forward; and backward for float32)."""
    native = ["aten::batch_norm_update_stats", "aten::native_batch_norm", "aten::native_batch_norm_backward"]
    assert run_distributed(_layouts_and_dtypes, 2) == [native] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uses_the_native_cuda_kernels_and_matches_the_joint_batch():
    # Two ranks share GPU 0 through gloo (which carries CUDA tensors); spawned, as a forked child cannot use CUDA.
    ranks = run_distributed(_layouts_and_dtypes, 2, "cuda", start_method="spawn", timeout=300)
    for ops in ranks:
        assert {"aten::batch_norm_backward_reduce", "aten::batch_norm_backward_elemt"} <= set(ops), ops
        assert "aten::native_batch_norm_backward" not in ops, ops
