"""Forward+backward time of the portable SyncBatchNorm vs local BatchNorm, on CPU processes joined by gloo.

Each of ``--world-size`` processes (one intra-op thread each) runs four interleaved arms per repetition, in an order
rotated every repetition so that drift in machine load hits every arm alike:

* ``local_bn``: ``torch.nn.BatchNorm1d/2d`` on its own batch, training forward + backward (what DDP without sync does);
* ``portable_syncbn``: :class:`lit_accel.plugins.sync_batchnorm.SyncBatchNorm` over the whole group (one fused
  ``all_reduce`` of ``2C+1`` numbers in forward, one of ``2C`` in backward);
* ``all_reduces``: the two bare collectives of the same payloads, back to back: the communication the sync cannot avoid;
* ``bn_with_all_reduces``: local BatchNorm with the same two collectives where the layer makes them (after the
  forward, and before the backward's kernel): any synchronised BatchNorm pays what waiting at them costs (a peer's
  lateness, the collective's threads, caches cooled meanwhile), which ``local + all_reduces`` leaves out.

for three cases (``--cases``): a ResNet-like activation ``nchw`` (default 8 x 64 x 56 x 56 per rank), the same in
``channels_last``, and ``bn1d``, an ``(N, C)`` input of an MLP (default 256 x 1024). A repetition's time is the slowest
rank's. The JSON gives, per case, the medians, and paired per-repetition ratios (median, quartiles) of

* ``ratio_portable_over_local_plus_all_reduces``: portable / (local + all-reduces), what the sync adds beyond its two
  collectives (the target); ``cpu_ratio_...`` the same in CPU time of the ranks' threads (waiting and descheduled time
  left out: the computation's part, steadier than wall time on a loaded machine);
* ``ratio_portable_over_bn_with_all_reduces`` (and ``cpu_...``): what the layer adds beyond BatchNorm that waits at the
  same two collectives;
* ``ratio_portable_over_local`` and the *communication limit* ``(local + all_reduces) / local``;

plus rank 0's page faults per arm (see ``--keep-freed-memory``) and ``aten_ops_per_step``: the operators each arm
dispatches per forward + backward (torch.profiler, one step; deterministic, whatever the load).

Run (from the repository root)::

    python benchmarks/syncbn.py                  # writes benchmarks/results/syncbn.json and syncbn.md
    python benchmarks/syncbn.py --keep-freed-memory --out /tmp/syncbn_no_faults.json
    python benchmarks/syncbn.py --cases nchw --reps 100 --out /tmp/syncbn_nchw.json
    python benchmarks/syncbn.py --tiny           # small shapes, a few repetitions: a smoke test

``python benchmarks/syncbn.py --help`` lists the options (world size, shapes, repetitions, cases).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _common

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

CASES = ("nchw", "channels_last", "bn1d")
_ARMS = ("local_bn", "portable_syncbn", "all_reduces", "bn_with_all_reduces")
# The JSON's top-level "median_ms" and "ratio_portable_over_local" are this case's (the script's original output).
DEFAULT_CASE = "nchw"


def _parse(argv: list[str] | None) -> Any:
    p = _common.parser("syncbn", __doc__)
    g = p.add_argument_group("shapes")
    g.add_argument("--world-size", type=_common.positive_int, default=2, help="processes")
    g.add_argument("--batch", type=_common.positive_int, default=8, help="samples per rank (nchw, channels_last)")
    g.add_argument("--channels", type=_common.positive_int, default=64, help="channels (nchw, channels_last)")
    g.add_argument("--size", type=_common.positive_int, default=56, help="height = width (nchw, channels_last)")
    g.add_argument("--bn1d-batch", type=_common.positive_int, default=256, help="samples per rank (bn1d)")
    g.add_argument("--bn1d-features", type=_common.positive_int, default=1024, help="features C (bn1d)")
    g = p.add_argument_group("timing")
    g.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which inputs to measure")
    g.add_argument("--reps", type=_common.positive_int, default=60, help="timed repetitions per arm and case")
    g.add_argument("--warmup", type=_common.positive_int, default=5, help="untimed repetitions first")
    g.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc: keep freed memory in the process (no re-mapping, no page faults) so that neither arm pays them",
    )
    g.add_argument("--tiny", action="store_true", help="small shapes and 3 repetitions (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.channels, args.size, args.bn1d_batch, args.bn1d_features = 2, 8, 6, 16, 32
        args.reps, args.warmup = 3, 1
    return args


def _shape(args: Any, case: str) -> tuple[int, ...]:
    if case == "bn1d":
        return (args.bn1d_batch, args.bn1d_features)
    return (args.batch, args.channels, args.size, args.size)


def _keep_freed_memory() -> None:
    # glibc returns a freed multi-MB block to the OS and maps a fresh one at the next allocation: one page fault per
    # 4 KiB page, paid by whichever arm allocates next, a matter of allocation order rather than of the layer. High
    # mmap and trim thresholds (what jemalloc/tcmalloc users get anyway) keep such blocks for reuse.
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>; 32 MiB is glibc's largest mmap threshold on 64 bits
    if not (libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 1 << 25)):
        raise RuntimeError("--keep-freed-memory: glibc's mallopt refused the thresholds. Fix: run without it.")


def _rank(rank: int, world_size: int, args: Any) -> dict[str, dict[str, Any]]:
    import torch

    if args.keep_freed_memory:
        _keep_freed_memory()
    torch.manual_seed(rank)
    return {case: _measure(args, case) for case in args.cases}


def _minor_faults() -> int:
    # Page faults of this thread: a fresh multi-MB allocation that glibc maps from the OS pays one per 4 KiB page, so
    # an arm's time depends on the allocator's state as well as on its kernels; the JSON reports them per arm.
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt if hasattr(resource, "RUSAGE_THREAD") else 0


def _measure(args: Any, case: str) -> dict[str, Any]:
    """Per-repetition wall times (s, slowest rank), CPU times (s, this thread, slowest rank) and page faults (this
    rank) of the arms of one case, the forward's collective alone, and the operators each layer dispatches."""
    import torch
    import torch.distributed as dist

    from lit_accel.plugins.sync_batchnorm import SyncBatchNorm

    shape = _shape(args, case)
    fmt = torch.channels_last if case == "channels_last" else torch.contiguous_format
    x = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()
    upstream = torch.randn(shape).contiguous(memory_format=fmt)
    channels = shape[1]
    local = torch.nn.BatchNorm1d(channels) if len(shape) == 2 else torch.nn.BatchNorm2d(channels)
    portable = SyncBatchNorm(channels)
    # The payloads of the layer's collectives: [Σx, Σx², n] in float64, [Σdy, Σdy·x̂] in float32.
    fwd_payload = torch.zeros(2 * channels + 1, dtype=torch.float64)
    bwd_payload = torch.zeros(2 * channels)

    def with_all_reduces(x: torch.Tensor) -> torch.Tensor:
        y = local(x)
        dist.all_reduce(fwd_payload)
        y.register_hook(lambda grad: dist.all_reduce(bwd_payload))  # before BatchNorm's backward kernel
        return y

    layers = {"local_bn": local, "portable_syncbn": portable, "bn_with_all_reduces": with_all_reduces}
    arms = list(_ARMS)
    wall: dict[str, list[float]] = {name: [] for name in (*arms, "fwd_only")}
    cpu: dict[str, list[float]] = {f"cpu_{name}": [] for name in arms}
    faults: dict[str, list[float]] = {f"faults_{name}": [] for name in arms}
    for rep in range(args.warmup + args.reps):
        for name in _common.rotated(arms, rep):
            dist.barrier()  # start together: a rank's time must not include waiting for a late peer's previous step
            start, start_cpu, start_faults = time.perf_counter(), time.thread_time(), _minor_faults()
            if name == "all_reduces":
                dist.all_reduce(fwd_payload)
                fwd_only = time.perf_counter() - start
                dist.all_reduce(bwd_payload)
            else:
                layers[name](x).backward(upstream)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            x.grad = None
            if rep >= args.warmup:
                wall[name].append(elapsed)
                cpu[f"cpu_{name}"].append(elapsed_cpu)
                faults[f"faults_{name}"].append(_minor_faults() - start_faults)
                if name == "all_reduces":
                    wall["fwd_only"].append(fwd_only)
    slowest = {name: _common.slowest_rank(values) for name, values in {**wall, **cpu}.items()}
    ops = {name: _aten_ops_per_step(layers[name], x, upstream) for name in ("local_bn", "portable_syncbn")}
    return {**slowest, **faults, "aten_ops_per_step": ops}


def _aten_ops_per_step(layer: Any, x: Any, upstream: Any) -> int:
    """Operators one forward + backward dispatches from Python and autograd (aten calls not made by another one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).backward(upstream)
    x.grad = None
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::") for e in aten)


def _paired(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    return _common.summarize(_common.paired_ratios(numerator, denominator))


def _summary(args: Any, case: str, times: dict[str, Any]) -> dict[str, Any]:
    ms = {name: [1e3 * t for t in values] for name, values in times.items() if name in _ARMS or name == "fwd_only"}
    cpu = {name: [1e3 * t for t in times[f"cpu_{name}"]] for name in _ARMS}
    local, portable, comm, in_place = (ms[name] for name in _ARMS)
    limit = [(a + c) / a for a, c in zip(local, comm)]
    return {
        "input_per_rank": list(_shape(args, case)),
        "memory_format": "channels_last" if case == "channels_last" else "contiguous",
        "median_ms": {
            "local_bn_fwd_bwd": round(_common.summarize(local)["median"], 3),
            "portable_syncbn_fwd_bwd": round(_common.summarize(portable)["median"], 3),
            "all_reduces_fwd_bwd": round(_common.summarize(comm)["median"], 3),
            "bn_with_all_reduces_fwd_bwd": round(_common.summarize(in_place)["median"], 3),
            # The script's original key: the forward's collective alone.
            "all_reduce_2C+1_fp64": round(_common.summarize(ms["fwd_only"])["median"], 3),
        },
        "ms": {"local_bn": _common.summarize(local), "portable_syncbn": _common.summarize(portable)},
        "median_cpu_ms": {name: round(_common.summarize(cpu[name])["median"], 3) for name in _ARMS},
        # The target: what the sync adds beyond local BatchNorm and its two collectives.
        "ratio_portable_over_local_plus_all_reduces": _paired(portable, [a + c for a, c in zip(local, comm)]),
        # CPU time of the rank's thread (descheduled time and waits excluded): the computation's part, less
        # sensitive to a shared machine's load than wall time.
        "cpu_ratio_portable_over_local_plus_all_reduces": _paired(
            cpu["portable_syncbn"], [a + c for a, c in zip(cpu["local_bn"], cpu["all_reduces"])]
        ),
        "ratio_portable_over_bn_with_all_reduces": _paired(portable, in_place),
        "cpu_ratio_portable_over_bn_with_all_reduces": _paired(cpu["portable_syncbn"], cpu["bn_with_all_reduces"]),
        "ratio_portable_over_local": _paired(portable, local),
        "communication_limit_ratio": _common.summarize(limit),
        "cpu_ratio_portable_over_local": _paired(cpu["portable_syncbn"], cpu["local_bn"]),
        "rank0_minor_page_faults_per_step": {
            name: _common.summarize(times[f"faults_{name}"])["median"] for name in ("local_bn", "portable_syncbn")
        },
        "aten_ops_per_step": times["aten_ops_per_step"],
    }


def _table(cases: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, c in cases.items():
        target = c["ratio_portable_over_local_plus_all_reduces"]
        ops = c["aten_ops_per_step"]
        rows.append(
            [
                name,
                " x ".join(map(str, c["input_per_rank"])),
                c["median_ms"]["local_bn_fwd_bwd"],
                c["median_ms"]["all_reduces_fwd_bwd"],
                c["median_ms"]["portable_syncbn_fwd_bwd"],
                f"{target['median']:.3f} ({target['q1']:.3f}-{target['q3']:.3f})",
                f"{c['cpu_ratio_portable_over_local_plus_all_reduces']['median']:.3f}",
                f"{c['ratio_portable_over_bn_with_all_reduces']['median']:.3f}",
                f"{c['communication_limit_ratio']['median']:.3f}",
                f"{ops['portable_syncbn']} / {ops['local_bn']}",
            ]
        )
    headers = [
        "case",
        "input per rank (fp32)",
        "local BN fwd+bwd (ms)",
        "its 2 all-reduces (ms)",
        "portable SyncBN fwd+bwd (ms)",
        "portable / (local + all-reduces) (IQR)",
        "same, CPU time",
        "portable / BN waiting at the 2 all-reduces",
        "communication limit",
        "aten ops per step (portable / local)",
    ]
    return _common.markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    per_rank = _common.launch(_rank, args.world_size, args, timeout=1800)
    cases = {case: _summary(args, case, per_rank[0][case]) for case in args.cases}
    result: dict[str, Any] = {
        "benchmark": "syncbn",
        "command": _common.command_line("syncbn.py", argv),
        "setup": {
            "world_size": args.world_size,
            "backend": "gloo",
            "device": "cpu",
            "threads_per_rank": 1,
            "dtype": "float32",
            "reps": args.reps,
            "warmup": args.warmup,
            "keep_freed_memory": args.keep_freed_memory,
            "machine": _common.machine_info(),
        },
        "cases": cases,
    }
    if DEFAULT_CASE in cases:
        result["median_ms"] = cases[DEFAULT_CASE]["median_ms"]
        result["ratio_portable_over_local"] = cases[DEFAULT_CASE]["ratio_portable_over_local"]["median"]
    _common.write_outputs(result, args.out, _table(cases))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
