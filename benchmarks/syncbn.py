"""Forward+backward time of the portable SyncBatchNorm vs local BatchNorm2d, on CPU processes joined by gloo.

Each of ``--world-size`` processes (one intra-op thread each) runs, interleaved in one loop, a training-mode
forward+backward of

* ``local_bn``: ``torch.nn.BatchNorm2d`` on its own batch (no communication: what DDP without sync does), and
* ``portable_syncbn``: :class:`lit_accel.plugins.sync_batchnorm.SyncBatchNorm` over the whole group (one fused
  ``all_reduce`` of ``2C+1`` numbers in forward, one of ``2C`` in backward),

on a ResNet-like activation (default: 8 samples per rank, 64 channels, 56x56). A step's time is the slowest rank's;
the JSON gives the median over ``--reps`` repetitions, the ratio portable/local, and the latency of one bare
``all_reduce`` of the forward's payload (how much of the difference is communication). The order of the two variants
alternates every repetition so that drift in machine load hits both alike.

Run (from the repository root)::

    python benchmarks/syncbn.py                      # writes benchmarks/results/syncbn.json
    python benchmarks/syncbn.py --reps 50 --channels-last --out /tmp/syncbn_cl.json

``python benchmarks/syncbn.py --help``::

    --world-size N     processes (default 2)
    --batch N          samples per rank (default 8)
    --channels C       channels (default 64)
    --size S           height = width (default 56)
    --reps R           timed repetitions per variant (default 50)
    --warmup W         untimed repetitions first (default 3)
    --channels-last    use channels_last memory format
    --out PATH         JSON output (default benchmarks/results/syncbn.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "syncbn.json"


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("shape")
    group.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    group.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    group.add_argument("--channels", type=int, default=64, help="channels (default 64)")
    group.add_argument("--size", type=int, default=56, help="height = width (default 56)")
    group.add_argument("--channels-last", action="store_true", help="use channels_last memory format")
    group = parser.add_argument_group("timing")
    group.add_argument("--reps", type=int, default=50, help="timed repetitions per variant (default 50)")
    group.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step(layer: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> float:
    dist.barrier()  # start together: a rank's time must not include waiting for a late peer's previous step
    start = time.perf_counter()
    out = layer(x)
    out.backward(upstream)
    elapsed = time.perf_counter() - start
    x.grad = None
    return elapsed


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    from lit_accel.plugins.sync_batchnorm import SyncBatchNorm

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=120),
    )
    torch.manual_seed(rank)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    shape = (args.batch, args.channels, args.size, args.size)
    x = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()
    upstream = torch.randn(shape).contiguous(memory_format=fmt)
    layers = {"local_bn": torch.nn.BatchNorm2d(args.channels), "portable_syncbn": SyncBatchNorm(args.channels)}
    times: dict[str, list[float]] = {name: [] for name in layers}
    for rep in range(args.warmup + args.reps):
        order = list(layers) if rep % 2 == 0 else list(reversed(layers))
        for name in order:
            elapsed = _step(layers[name], x, upstream)
            if rep >= args.warmup:
                times[name].append(elapsed)

    payload = torch.zeros(2 * args.channels + 1, dtype=torch.float64)
    latency = []
    for rep in range(args.warmup + args.reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(payload)
        if rep >= args.warmup:
            latency.append(time.perf_counter() - start)
    times["all_reduce_payload"] = latency

    # The step time is the slowest rank's, repetition by repetition.
    per_rank = torch.tensor([times[name] for name in times], dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({name: per_rank[i].tolist() for i, name in enumerate(times)})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, args, port, queue)) for rank in range(args.world_size)]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=600)
    for proc in procs:
        proc.join()
    median_ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    result = {
        "benchmark": "syncbn",
        "command": " ".join(["python benchmarks/syncbn.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {
            "world_size": args.world_size,
            "backend": "gloo",
            "device": "cpu",
            "threads_per_rank": 1,
            "input_per_rank": [args.batch, args.channels, args.size, args.size],
            "memory_format": "channels_last" if args.channels_last else "contiguous",
            "dtype": "float32",
            "reps": args.reps,
            "warmup": args.warmup,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "median_ms": {
            "local_bn_fwd_bwd": round(median_ms["local_bn"], 3),
            "portable_syncbn_fwd_bwd": round(median_ms["portable_syncbn"], 3),
            "all_reduce_2C+1_fp64": round(median_ms["all_reduce_payload"], 3),
        },
        "ratio_portable_over_local": round(median_ms["portable_syncbn"] / median_ms["local_bn"], 3),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
