"""Check 4 of ``gpu_check.py``: SyncBatchNorm on CUDA, torch's and lit_accel's: equal results, time, and "auto".

* Both layers equal BatchNorm on the joint batch (2 processes: NCCL on two GPUs, or gloo sharing one GPU), and torch's
  run shows its fused kernels.
* Step time and host syncs of a network of 8 conv + BatchNorm layers with each implementation, interleaved
  repetitions. One GPU has no second rank, so each layer runs its synchronising autograd function in a process group
  of one (NCCL): the collectives are trivial, and what differs is each layer's own work, its host syncs included
  (torch's forward indexes with a boolean mask, one sync per layer; lit_accel's makes none).
* ``AccelSyncBatchNorm("auto")`` on CUDA with NCCL must pick the faster one (``AUTO_ON_CUDA_NCCL``; a difference
  under 2% is a tie): a FAIL says which value to give it.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import _common
import torch
from _gpu_arms import Row, row, sync
from torch import nn

FUSED_SYNCBN_OPS = (
    "aten::batch_norm_stats",
    "aten::batch_norm_gather_stats_with_counts",
    "aten::batch_norm_elemt",
    "aten::batch_norm_backward_reduce",
    "aten::batch_norm_backward_elemt",
)
TIE = 0.02  # a difference below 2% of step time is a tie: "auto" may pick either


def _syncbn_rank(rank: int, world_size: int, use_cuda: bool) -> dict[str, Any]:
    """One rank: torch's SyncBatchNorm, the portable one, and BatchNorm on the joint batch; returns the differences."""
    import torch.distributed as dist

    from lit_accel.plugins.layer_sync import AccelSyncBatchNorm

    backend = dist.get_backend()
    device = torch.device("cuda", rank if backend == "nccl" else 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(0)
    channels, per_rank = 8, 4
    x_all = (torch.randn(world_size * per_rank, channels, 6, 6, generator=g) * 3 + 1).to(device)
    up_all = torch.randn(x_all.shape, generator=g).to(device)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        return nn.Sequential(bn).to(device)

    # Reference: plain BatchNorm on the concatenated batch.
    ref = fresh()
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * up_all).sum().backward()
    out_ref_full, ref_bn = y_ref.detach(), ref[0]

    impls = ["portable"] + (["torch"] if use_cuda else [])
    out: dict[str, Any] = {}
    for impl in impls:
        model = fresh()
        plugin = AccelSyncBatchNorm(implementation=impl)  # type: ignore[arg-type]
        model = plugin.apply(model)
        x = x_all[sl].clone().requires_grad_()
        ops: set[str] = set()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if rank == 0 else None
        with profiler if profiler is not None else contextlib.nullcontext():
            y = model(x)
            (y * up_all[sl]).sum().backward()
        if profiler is not None:
            ops = {evt.key for evt in profiler.key_averages()}
        bn = model[0]
        grads = torch.cat([bn.weight.grad, bn.bias.grad])
        dist.all_reduce(grads)  # the joint-batch gradient is the sum of the ranks' contributions
        pairs = {
            "output": (y.detach(), out_ref_full[sl]),
            "input_grad": (x.grad, x_ref.grad[sl]),
            "param_grad": (grads, torch.cat([ref_bn.weight.grad, ref_bn.bias.grad])),
            "running_mean": (bn.running_mean, ref_bn.running_mean),
            "running_var": (bn.running_var, ref_bn.running_var),
        }
        # max |a - b| / max(1, max |b|): absolute for values of order 1, relative for large ones (summed gradients).
        diffs = {k: float((a - b).abs().max() / b.abs().max().clamp_min(1.0)) for k, (a, b) in pairs.items()}
        out[impl] = {
            "class": type(bn).__module__ + "." + type(bn).__name__,
            "max_abs_diff_vs_joint_batch": diffs,
            "fused_ops_seen": sorted(op for op in FUSED_SYNCBN_OPS if op in ops),
        }
    return out


class _ForcedSync(nn.Module):
    """A BatchNorm2d that runs an implementation's synchronising autograd function even in a group of one.

    Both functions are private (``torch.nn.modules._functions.SyncBatchNorm``, lit_accel's
    ``_SyncBatchNormFunction``): the modules skip them when the group has one rank, and one GPU gives no second rank.
    """

    def __init__(self, channels: int, impl: str, group: Any) -> None:
        super().__init__()
        self.bn, self.impl, self.group = nn.BatchNorm2d(channels), impl, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        args = (x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, self.group)
        if self.impl == "torch":
            from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFunction

            return TorchSyncFunction.apply(*args, 1)
        from lit_accel.plugins.sync_batchnorm import _SyncBatchNormFunction

        return _SyncBatchNormFunction.apply(*args)


def _net(ctx: dict[str, Any], impl: str, channels: int, layers: int) -> nn.Module:
    import torch.distributed as dist

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        blocks += [conv, _ForcedSync(channels, impl, dist.group.WORLD), nn.ReLU()]
    return nn.Sequential(*blocks).to(ctx["device"])


def _host_syncs(ctx: dict[str, Any], step: Any) -> int | None:
    """Host-device syncs of one ``step()``, from CUDA's sync debug mode (None on CPU)."""
    if not ctx["cuda"]:
        return None
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in records)


def _timing(ctx: dict[str, Any]) -> dict[str, Any]:
    """ms per forward + backward and host syncs per step of each implementation, interleaved repetitions."""
    dry = ctx["dry_run"]
    channels, layers, size, batch = (8, 2, 8, 4) if dry else (64, 8, 56, 32)
    impls = ["portable", "torch"] if ctx["cuda"] else ["portable"]  # torch's needs CUDA kernels
    nets = {impl: _net(ctx, impl, channels, layers) for impl in impls}
    x = torch.randn(batch, channels, size, size, device=ctx["device"])

    def step(impl: str) -> None:
        nets[impl](x).sum().backward()

    out: dict[str, Any] = {impl: {"ms": [], "host_syncs_per_step": None} for impl in impls}
    for impl in impls:
        for _ in range(3):  # warm-up (cuDNN autotuning, allocator)
            step(impl)
        out[impl]["host_syncs_per_step"] = _host_syncs(ctx, lambda impl=impl: step(impl))
    steps, reps = (2, 2) if dry else (20, 6)
    for rep in range(reps):
        for impl in _common.rotated(impls, rep):
            sync(ctx)
            start = time.perf_counter()
            for _ in range(steps):
                step(impl)
            sync(ctx)
            out[impl]["ms"].append((time.perf_counter() - start) / steps * 1e3)
    for impl in impls:
        out[impl]["median_ms"] = _common.summarize(out[impl]["ms"])["median"]
    out["layers"], out["input"] = layers, [batch, channels, size, size]
    return out


def _timing_rows(ctx: dict[str, Any], timing: dict[str, Any]) -> list[Row]:
    from lit_accel.plugins.layer_sync import AUTO_ON_CUDA_NCCL

    portable = timing["portable"]
    shape = f"{timing['layers']} conv+BN layers on {'x'.join(map(str, timing['input']))}"
    if "torch" not in timing:
        detail = f"lit_accel {portable['median_ms']:.2f} ms/step ({shape}); CPU dry run: torch's layer is CUDA-only"
        return [row("SyncBN step time, torch vs lit_accel", "INFO", detail)]
    theirs = timing["torch"]
    ratio = theirs["median_ms"] / portable["median_ms"]
    faster = "portable" if ratio > 1 - TIE else "torch"
    tie = abs(ratio - 1) < TIE
    verdict = "PASS" if tie or faster == AUTO_ON_CUDA_NCCL else "FAIL"
    fix = "" if verdict == "PASS" else f"; set AUTO_ON_CUDA_NCCL = {faster!r} in lit_accel/plugins/layer_sync.py"
    no_sync = portable["host_syncs_per_step"] == 0
    return [
        row(
            "SyncBN step time, torch vs lit_accel",
            "INFO",
            f"torch {theirs['median_ms']:.2f} ms, lit_accel {portable['median_ms']:.2f} ms per step (torch / lit_accel"
            f" x{ratio:.3f}; {shape}, world of one); host syncs/step: torch {theirs['host_syncs_per_step']},"
            f" lit_accel {portable['host_syncs_per_step']}",
        ),
        row(
            "SyncBN lit_accel layer makes no host sync",
            "PASS" if no_sync else "FAIL",
            f"{portable['host_syncs_per_step']} per step over {timing['layers']} layers",
        ),
        row(
            "SyncBN 'auto' on CUDA+NCCL picks the faster",
            verdict,
            f"auto -> {AUTO_ON_CUDA_NCCL}; measured faster: {'tie' if tie else faster} (x{ratio:.3f}){fix}",
        ),
    ]


def check_syncbn(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    import torch.distributed as dist

    from lit_accel.plugins.layer_sync import AUTO_ON_CUDA_NCCL, AccelSyncBatchNorm

    rows, data = [], {}
    # "auto" in this process, in a one-rank group (the sync check's Trainer may have created it already).
    if not dist.is_initialized():
        address = f"tcp://127.0.0.1:{_common.free_port()}"
        dist.init_process_group("nccl" if ctx["cuda"] else "gloo", init_method=address, rank=0, world_size=1)
    model = nn.Sequential(nn.BatchNorm2d(4)).to(ctx["device"])
    plugin = AccelSyncBatchNorm()
    model = plugin.apply(model)
    want = AUTO_ON_CUDA_NCCL if ctx["cuda"] and dist.get_backend() == "nccl" else "portable"
    got = plugin.resolved_implementation
    data["auto_resolves_to"] = {"implementation": got, "class": type(model[0]).__name__}
    rows.append(
        row(
            "SyncBN 'auto' implementation",
            "PASS" if got == want else "FAIL",
            f"{dist.get_backend()} on {ctx['device'].type}: {got} -> {type(model[0]).__name__} (expected {want})",
        )
    )
    data["timing"] = _timing(ctx)
    rows += _timing_rows(ctx, data["timing"])
    backend = "nccl" if ctx["cuda"] and torch.cuda.device_count() >= 2 else "gloo"
    ranks = _common.launch(_syncbn_rank, 2, ctx["cuda"], backend=backend, timeout=300)
    tol = 1e-4
    for impl, result in ranks[0].items():
        worst = max(max(rk[impl]["max_abs_diff_vs_joint_batch"].values()) for rk in ranks)
        ok = worst < tol
        detail = f"{result['class']}, 2 ranks ({backend}): max normalised abs. diff. vs BN on joint batch {worst:.1e}"
        if impl == "torch":
            missing = [op for op in FUSED_SYNCBN_OPS if op not in result["fused_ops_seen"]]
            ok = ok and not missing
            detail += "; fused kernels: " + ("all 5 seen" if not missing else f"MISSING {missing}")
        rows.append(row(f"SyncBN {impl} == BatchNorm(joint batch)", "PASS" if ok else "FAIL", detail))
        data[impl] = [rk[impl] for rk in ranks]
    if not ctx["cuda"]:
        rows.append(row("SyncBN torch fused kernels", "n/a", "CPU dry run: torch.nn.SyncBatchNorm is CUDA-only"))
    data["backend"] = backend
    return rows, data


CHECKS = {"syncbn": check_syncbn}
