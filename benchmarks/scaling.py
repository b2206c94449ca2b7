"""Weak and strong scaling efficiency of DDP on 1..N CPU processes, and a ring all-reduce model that extrapolates.

**Measured.** ``max(--procs)`` processes joined by gloo run, in interleaved repetitions, every (mode, N) arm: N = 1 is
a plain loop on one process (no DDP: the true one-device time), N > 1 a ``DistributedDataParallel`` loop over the
sub-group of ranks ``0..N-1`` (the other ranks wait in a barrier, which costs no CPU). The model is the CIFAR-sized
ViT of ``overhead.py`` (fp32, AdamW, one thread per process). Definitions (the seed's):

* strong scaling, fixed global batch ``--global-batch`` split over N processes:
  ``efficiency = (T1 / TN) / N``;
* weak scaling, fixed per-process batch ``--batch``: ``efficiency = T1 / TN``,

where ``TN`` is the mean step time on N processes (slowest rank) over ``--steps`` steps after ``--warmup``, median
over ``--reps`` repetitions; the spread is reported. With ``--procs 1 2 4`` on a 2-core machine the 4-process points
are oversubscribed (two processes per core): their efficiency measures the CPU shortage, not DDP.

**Model.** A ring all-reduce of K bytes moves ``2 K (N-1) / N`` bytes through every device in ``2 (N-1)`` steps
(Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"; nccl-tests
``doc/PERFORMANCE.md`` calls ``K / t x 2(N-1)/N`` the bus bandwidth), so
``t_comm = 2 K (N-1) / N / bw + 2 (N-1) alpha`` and, with a fraction ``--overlap`` of it hidden behind the backward,
``efficiency = t_compute / (t_compute + (1 - overlap) t_comm)``. Weak scaling keeps ``t_compute = T1`` (measured at
``--batch``); strong scaling splits ``--predict-global-batch`` images over N devices, ``t_compute = (T1 / batch) x
global / N`` (compute linear in the batch: optimistic at small per-device batches). K is the fp32 gradient
(4 bytes x parameters) unless ``--grad-mb`` is given; ``--t-compute-ms`` replaces the measured T1, e.g. with a
GPU step time from ``gpu_check.py``. The bandwidths are per-device link speeds, ``--bandwidth NAME=GB/s[:alpha_us]``,
by default NVLink 4 (450 GB/s per direction per H100/H200, NVIDIA datasheet; within one node of 8 only), InfiniBand
NDR 400 Gb/s and HDR 200 Gb/s, and 100/25 Gb Ethernet; the latencies are typical orders of magnitude, not
measurements. The same model, fed with the all-reduce bandwidth and latency measured here on gloo, predicts the
measured points: the plot shows both, so the reader sees how far the model is from reality on this machine.

Run (from the repository root)::

    python benchmarks/scaling.py                         # writes benchmarks/results/scaling.json, .md and .png
    python benchmarks/scaling.py --procs 1 2 4           # 4 processes oversubscribe a 2-core machine
    python benchmarks/scaling.py --t-compute-ms 270 --grad-mb 344 --overlap 0.5   # ViT-B/16 numbers from a GPU
    python benchmarks/scaling.py --tiny                  # a few seconds: checks that it runs
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import _common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# name -> (per-device bandwidth in GB/s, latency per ring step in microseconds, largest N it applies to)
DEFAULT_BANDWIDTHS: dict[str, tuple[float, float, int | None]] = {
    "NVLink 4 (450 GB/s)": (450.0, 3.0, 8),
    "IB NDR (400 Gb/s)": (50.0, 5.0, None),
    "IB HDR (200 Gb/s)": (25.0, 5.0, None),
    "Ethernet 100 Gb/s": (12.5, 20.0, None),
    "Ethernet 25 Gb/s": (3.125, 30.0, None),
}
PREDICT_N = [2**i for i in range(0, 9)]  # 1 .. 256


def build_net(kind: str) -> nn.Module:
    """The benchmark model (``overhead.py``'s ViT), with fixed initial weights."""
    torch.manual_seed(0)
    if kind == "vit":
        import timm

        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=4, depth=6
        )
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.GELU(), nn.Linear(16, 10))


def ring_time_s(grad_bytes: float, n: int, bw_bytes_s: float, alpha_s: float) -> float:
    """Ring all-reduce time of ``grad_bytes`` on ``n`` devices (0 for one device)."""
    if n <= 1:
        return 0.0
    return 2 * grad_bytes * (n - 1) / n / bw_bytes_s + 2 * (n - 1) * alpha_s


def predicted_efficiency(
    t_compute_s: float, grad_bytes: float, n: int, bw: float, alpha: float, overlap: float
) -> float:
    """``t_compute / (t_compute + exposed communication)``."""
    exposed = (1.0 - overlap) * ring_time_s(grad_bytes, n, bw, alpha)
    return t_compute_s / (t_compute_s + exposed)


def _train(net: nn.Module, group: Any, batch: int, steps: int, seed: int) -> list[float]:
    """Step-start stamps of ``steps`` fp32 steps on random data; DDP over ``group`` unless it is None."""
    from torch.nn.parallel import DistributedDataParallel

    model: nn.Module = net if group is None else DistributedDataParallel(net, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    stamps = []
    for _ in range(steps + 1):
        stamps.append(time.perf_counter())
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return stamps


def _allreduce_times(group: Any, numel: int, reps: int) -> list[float]:
    buf = torch.zeros(numel)
    out = []
    for _ in range(reps + 2):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        out.append(time.perf_counter() - start)
    return out[2:]


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    """Every process: all (mode, N) arms interleaved; then bare all-reduce timings per N."""
    # Every rank creates every sub-group, in the same order (a torch.distributed.new_group requirement).
    groups = {n: dist.new_group(list(range(n))) for n in args.procs if n > 1}
    arms = [(mode, n) for mode in ("weak", "strong") for n in args.procs]
    times: dict[str, list[float]] = {f"{mode}/{n}": [] for mode, n in arms}
    for rep in range(args.reps):
        for mode, n in _common.rotated(arms, rep):
            dist.barrier()
            if rank < n:
                batch = args.batch if mode == "weak" else args.global_batch // n
                stamps = _train(build_net(args.model), groups.get(n), batch, args.warmup + args.steps, seed=rank)
                times[f"{mode}/{n}"].append(_common.mean_period(stamps, args.warmup, args.steps))
            else:
                times[f"{mode}/{n}"].append(0.0)  # idle in this arm; the max over ranks ignores it
    slowest = {key: _common.slowest_rank(values) for key, values in times.items()}
    comm: dict[str, Any] = {}
    numel = sum(p.numel() for p in build_net(args.model).parameters())
    for n, group in groups.items():
        dist.barrier()
        if rank < n:
            comm[str(n)] = {
                "grad": _allreduce_times(group, numel, args.comm_reps),
                "tiny": _allreduce_times(group, 1, args.comm_reps),
            }
    return {"times": slowest, "comm": comm, "params": numel}


def _parse_bandwidths(specs: list[str] | None) -> dict[str, tuple[float, float, int | None]]:
    if not specs:
        return dict(DEFAULT_BANDWIDTHS)
    out: dict[str, tuple[float, float, int | None]] = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        bw, _, alpha = value.partition(":")
        try:
            out[name] = (float(bw), float(alpha) if alpha else 5.0, None)
        except ValueError as err:
            raise SystemExit(f"--bandwidth {spec!r}: expected NAME=GB/s[:alpha_us], e.g. 'IB NDR=50:5'") from err
    return out


def plot(result: dict[str, Any], path: Any) -> None:
    """Measured vs predicted efficiency on this machine (left), predicted at 1..256 devices (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    measured = result["measured"]
    for mode, color in (("weak", "tab:blue"), ("strong", "tab:orange")):
        ns = sorted(int(n) for n in measured[mode])
        med = [measured[mode][str(n)]["efficiency"]["median"] for n in ns]
        lo = [m - measured[mode][str(n)]["efficiency"]["min"] for n, m in zip(ns, med)]
        hi = [measured[mode][str(n)]["efficiency"]["max"] - m for n, m in zip(ns, med)]
        left.errorbar(ns, med, yerr=[lo, hi], fmt="o-", color=color, capsize=4, label=f"{mode}: measured (min-max)")
        local = result["model_on_this_machine"][mode]
        pn = sorted(int(n) for n in local)
        left.plot(pn, [local[str(n)] for n in pn], "x--", color=color, label=f"{mode}: model, measured gloo bw")
    left.set_xlabel("processes N")
    left.set_ylabel("scaling efficiency")
    left.set_xticks(sorted({int(n) for n in measured["weak"]}))
    left.set_ylim(0, 1.1)
    left.axhline(1.0, color="grey", lw=0.5)
    left.set_title(f"Measured on {result['machine']['cpu_count']} CPU cores (gloo)")
    left.legend(fontsize=8)

    pred = result["predicted"]
    for i, (name, curves) in enumerate(pred["curves"].items()):
        color = f"C{i}"
        for mode, style in (("weak", "-"), ("strong", "--")):
            ns = [int(n) for n in curves[mode]]
            right.plot(ns, [curves[mode][str(n)] for n in ns], style, color=color, label=f"{name}, {mode}")
    right.set_xscale("log", base=2)
    right.set_xticks(PREDICT_N)
    right.set_xticklabels([str(n) for n in PREDICT_N])
    right.set_ylim(0, 1.05)
    right.set_xlabel("devices N")
    right.set_ylabel("predicted efficiency")
    right.set_title(
        f"Ring all-reduce model: t_compute {pred['t_compute_ms']:.1f} ms, K {pred['grad_mb']:.1f} MB,"
        f" overlap {pred['overlap']:.0%}",
        fontsize=9,
    )
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("scaling", __doc__)
    p.add_argument("--procs", type=_common.positive_int, nargs="+", default=[1, 2], help="process counts to measure")
    p.add_argument("--batch", type=_common.positive_int, default=16, help="weak scaling: images per process")
    p.add_argument("--global-batch", type=_common.positive_int, default=32, help="strong scaling: images in all")
    p.add_argument("--steps", type=_common.positive_int, default=5, help="timed steps per repetition")
    p.add_argument("--warmup", type=_common.positive_int, default=2, help="untimed steps per repetition")
    p.add_argument("--reps", type=_common.positive_int, default=5, help="interleaved repetitions")
    p.add_argument("--comm-reps", type=_common.positive_int, default=20, help="bare all-reduce timings per N")
    p.add_argument("--model", choices=("vit", "tiny"), default="vit", help="benchmark model")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of all-reduce hidden behind the backward")
    p.add_argument("--bandwidth", action="append", help="NAME=GB/s[:alpha_us] (repeatable); default: 5 presets")
    p.add_argument("--t-compute-ms", type=float, default=None, help="one-device step time for the prediction")
    p.add_argument("--grad-mb", type=float, default=None, help="gradient bytes K (MB) for the prediction")
    p.add_argument("--predict-global-batch", type=_common.positive_int, default=4096, help="strong prediction")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    args.procs = sorted(set(args.procs))
    if 1 not in args.procs:
        args.procs = [1, *args.procs]
    if not 0.0 <= args.overlap <= 1.0:
        p.error(f"--overlap {args.overlap}: expected a fraction in [0, 1]")
    if any(args.global_batch % n for n in args.procs):
        p.error(f"--global-batch {args.global_batch} must be divisible by every process count {args.procs}")
    bandwidths = _parse_bandwidths(args.bandwidth)
    if args.tiny:
        args.model, args.steps, args.warmup, args.reps, args.comm_reps, args.batch = "tiny", 2, 1, 1, 2, 4
        args.global_batch = 4 * math.lcm(*args.procs)

    machine = _common.machine_info()
    start = time.perf_counter()
    ranks = _common.launch(worker, max(args.procs), args)
    wall = time.perf_counter() - start
    r0 = ranks[0]
    times = r0["times"]
    t1 = {mode: times[f"{mode}/1"] for mode in ("weak", "strong")}
    measured: dict[str, Any] = {"weak": {}, "strong": {}}
    rows = []
    for mode in ("weak", "strong"):
        for n in args.procs:
            tn = times[f"{mode}/{n}"]
            # weak: T1 / TN; strong: (T1 / TN) / N
            divisor = 1 if mode == "weak" else n
            eff = [a / b / divisor for a, b in zip(t1[mode], tn)]
            entry = {
                "step_ms": _common.summarize([1e3 * t for t in tn], 2),
                "efficiency": _common.summarize(eff, 3),
                "per_process_batch": args.batch if mode == "weak" else args.global_batch // n,
                "oversubscribed": n > (machine["cpu_count"] or n),
            }
            measured[mode][str(n)] = entry
            rows.append([
                mode, n, entry["per_process_batch"], f"{entry['step_ms']['median']:.1f}",
                f"{entry['step_ms']['q1']:.1f}-{entry['step_ms']['q3']:.1f}", f"{entry['efficiency']['median']:.3f}",
                f"{entry['efficiency']['min']:.3f}-{entry['efficiency']['max']:.3f}",
                "yes" if entry["oversubscribed"] else "no",
            ])  # fmt: skip

    grad_bytes = 4.0 * r0["params"]
    # Measured gloo all-reduce on this machine: bus bandwidth and per-step latency, per N.
    comm: dict[str, Any] = {}
    model_local: dict[str, dict[str, float]] = {"weak": {"1": 1.0}, "strong": {"1": 1.0}}
    t1_weak = statistics.median(t1["weak"])
    t1_strong = statistics.median(t1["strong"])
    for n_str, c in r0["comm"].items():
        n = int(n_str)
        t_grad, t_tiny = statistics.median(c["grad"]), statistics.median(c["tiny"])
        alpha = t_tiny / (2 * (n - 1))
        bw = 2 * grad_bytes * (n - 1) / n / max(t_grad - 2 * (n - 1) * alpha, 1e-9)
        comm[n_str] = {
            "allreduce_grad_ms": round(1e3 * t_grad, 3),
            "allreduce_1_float_ms": round(1e3 * t_tiny, 4),
            "busbw_gb_s": round(bw / 1e9, 3),
            "alpha_us": round(1e6 * alpha, 2),
        }
        model_local["weak"][n_str] = round(predicted_efficiency(t1_weak, grad_bytes, n, bw, alpha, args.overlap), 4)
        model_local["strong"][n_str] = round(
            predicted_efficiency(t1_strong / n, grad_bytes, n, bw, alpha, args.overlap), 4
        )

    t_compute = args.t_compute_ms / 1e3 if args.t_compute_ms else t1_weak
    k_bytes = args.grad_mb * 1e6 if args.grad_mb else grad_bytes
    curves: dict[str, Any] = {}
    for name, (bw_gb, alpha_us, max_n) in bandwidths.items():
        bw, alpha = bw_gb * 1e9, alpha_us * 1e-6
        ns = [n for n in PREDICT_N if max_n is None or n <= max_n]
        weak = {str(n): round(predicted_efficiency(t_compute, k_bytes, n, bw, alpha, args.overlap), 4) for n in ns}
        strong = {}
        for n in ns:
            per_device = args.predict_global_batch / n
            if per_device < 1:
                break
            tc = t_compute / args.batch * per_device
            strong[str(n)] = round(predicted_efficiency(tc, k_bytes, n, bw, alpha, args.overlap), 4)
        curves[name] = {"bw_gb_s": bw_gb, "alpha_us": alpha_us, "max_devices": max_n, "weak": weak, "strong": strong}

    result: dict[str, Any] = {
        "benchmark": "scaling",
        "command": _common.command_line("scaling.py", argv),
        "machine": machine,
        "load_average_after": _common.load_average(),
        "wall_s": round(wall, 1),
        "setup": {
            "model": args.model,
            "parameters": r0["params"],
            "grad_mb_fp32": round(grad_bytes / 1e6, 3),
            "precision": "fp32",
            "optimizer": "AdamW",
            "threads_per_process": 1,
            "backend": "gloo",
            "procs": args.procs,
            "weak_batch_per_process": args.batch,
            "strong_global_batch": args.global_batch,
            "timed_steps_per_rep": args.steps,
            "warmup_steps_per_rep": args.warmup,
            "reps": args.reps,
        },
        "measured": measured,
        "allreduce_on_this_machine": comm,
        "model_on_this_machine": model_local,
        "predicted": {
            "t_compute_ms": round(1e3 * t_compute, 3),
            "t_compute_source": "--t-compute-ms" if args.t_compute_ms else "measured T1 (weak, one process)",
            "grad_mb": round(k_bytes / 1e6, 3),
            "overlap": args.overlap,
            "strong_global_batch": args.predict_global_batch,
            "per_device_batch_at_t_compute": args.batch,
            "curves": curves,
        },
    }
    table = _common.markdown_table(
        ["mode", "N", "batch / process", "median step (ms)", "IQR (ms)", "efficiency", "min-max", "oversubscribed"],
        rows,
    )
    comm_rows = [[n, c["allreduce_grad_ms"], c["busbw_gb_s"], c["alpha_us"], model_local["weak"][n],
                  model_local["strong"][n]] for n, c in comm.items()]  # fmt: skip
    table += "\n" + _common.markdown_table(
        ["N", "all-reduce of K (ms)", "bus bw (GB/s)", "alpha (us)", "model: weak eff.", "model: strong eff."],
        comm_rows,
    )
    pred_rows = [
        [name, c["bw_gb_s"], c["alpha_us"]] + [c["weak"].get(str(n), "") for n in (8, 32, 64, 256)]
        + [c["strong"].get(str(n), "") for n in (8, 32, 64, 256)]
        for name, c in curves.items()
    ]  # fmt: skip
    table += "\n" + _common.markdown_table(
        ["link", "GB/s", "alpha (us)", "weak N=8", "weak N=32", "weak N=64", "weak N=256",
         "strong N=8", "strong N=32", "strong N=64", "strong N=256"],
        pred_rows,
    )  # fmt: skip
    png = args.out.with_suffix(".png")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(result, png)
    result["plot"] = str(png.name)
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
