"""Gradient all-reduces per optimizer step under gradient accumulation: AccelDDP (no_sync) vs a naive DDP loop.

With ``k`` micro-batches per optimizer step, DDP all-reduces the gradient buckets after *every* backward unless the
non-final micro-batches run under ``model.no_sync()``. Lightning enters ``no_sync`` for them
(``loops/utilities.py::_block_parallel_sync_behavior``), so ``AccelDDP`` issues one round of bucket all-reduces per
optimizer step; a naive loop issues ``k``. Two CPU processes joined by gloo run, interleaved in one run, for each
``k`` in ``--k``:

* ``naive``: a raw ``DistributedDataParallel`` loop that calls ``backward`` on every micro-batch (loss / k) and steps
  every k-th, without ``no_sync``;
* ``raw_no_sync``: the same loop with ``no_sync()`` on the non-final micro-batches (the textbook fix);
* ``accel_ddp``: ``Trainer(strategy=AccelDDP(), accumulate_grad_batches=k)``: AccelDDP's default, no comm hook
  (DDP's built-in C++ all-reduce), as users run it;
* ``accel_ddp_bf16``: the same with ``AccelDDP(comm_hook="bf16")`` (gradients compressed to 16 bits on the wire).

The raw loops and ``accel_ddp_bf16`` count their collectives with one wrapper (``AccelDDP``'s ``counting_comm_hook``
around the hook, registered on the raw loops by hand with torch's ``allreduce_hook``). ``accel_ddp`` reads
``strategy.comm_stats`` too, which without a hook derives calls and bytes from the all-reduce rounds AccelDDP counts
(one per synchronised backward) and DDP's bucket layout; as an independent check of those rounds it also reports DDP's
own count of synchronised iterations per optimizer step (``ddp_sync_iterations_per_step``: the difference of the
``iteration`` field of DDP's logging data, which AccelDDP has DDP sample every iteration on CPU). ``bytes`` is the
payload handed to the all-reduce per rank (a ring moves about ``2(n-1)/n`` times it). The expected payload of one
round is ``4 x parameters`` bytes (fp32 gradients; half with ``bf16``), reported next to the measurement. Time per
optimizer step is the mean over ``--steps`` steps after ``--warmup`` steps, slowest rank, median over ``--reps``
interleaved repetitions; "saved" is ``naive - arm``. All arms start from the same weights and see the same
micro-batches in the same order, so their final weights must agree: the largest difference is reported as a check
that they do the same math (the bf16 arm differs by design).

The default model is an MLP with a large gradient (6.3 M parameters, 25 MB) and a small compute per micro-batch, so
that communication is a visible share of the step, as for a large model on a fast accelerator.

Run (from the repository root)::

    python benchmarks/accumulation.py                    # writes benchmarks/results/accumulation.json (+ .md)
    python benchmarks/accumulation.py --k 1 4 --reps 3 --out /tmp/acc.json
    python benchmarks/accumulation.py --tiny             # a few seconds: checks that it runs
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import _common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ARMS = ("naive", "raw_no_sync", "accel_ddp", "accel_ddp_bf16")
IN_FEATURES = 1024


def build_net(kind: str) -> nn.Module:
    """The benchmark model, with fixed initial weights."""
    torch.manual_seed(0)
    width = {"mlp": 2048, "tiny": 32}[kind]
    return nn.Sequential(
        nn.Linear(IN_FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def make_loader(rank: int, world_size: int, batch: int, batches: int) -> DataLoader:
    """``batches`` micro-batches per rank in a fixed order."""
    g = torch.Generator().manual_seed(1)
    n = world_size * batch * batches
    data = TensorDataset(torch.randn(n, IN_FEATURES, generator=g), torch.randint(0, 10, (n,), generator=g))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)


def _flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def run_raw(arm: str, k: int, args: Any, loader: DataLoader) -> dict[str, Any]:
    """A raw DDP accumulation loop, with (``raw_no_sync``) or without (``naive``) ``no_sync``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.strategies.ddp._comm_hooks import counting_comm_hook
    from lit_accel.strategies.parts._comm_stats import HookCommStats

    net = build_net(args.model)
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    stats = HookCommStats()
    model.register_comm_hook(None, counting_comm_hook(default_hooks.allreduce_hook, "allreduce", stats))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stamps, counts = [], []
    for i, (x, y) in enumerate(loader):
        final = (i + 1) % k == 0
        if i % k == 0:
            stamps.append(time.perf_counter())
            counts.append((stats.calls, stats.bytes, 0))
        sync = contextlib.nullcontext() if final or arm == "naive" else model.no_sync()
        with sync:
            # Divided by k as Lightning does: the accumulated gradient is the mean over the window.
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
        if final:
            opt.step()
            opt.zero_grad(set_to_none=True)
    stamps.append(time.perf_counter())
    counts.append((stats.calls, stats.bytes, 0))
    return {"stamps": stamps, "counts": counts, "params": _flat_params(net)}


def run_trainer(arm: str, k: int, args: Any, loader: DataLoader, world_size: int) -> dict[str, Any]:
    """One Lightning fit with AccelDDP and ``accumulate_grad_batches=k``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lit_accel import AccelDDP
    from lit_accel.utilities._compat import ddp_logging_data

    class StepClock(Callback):
        """Stamps the start of every accumulation window and reads the strategy's counters there."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.counts: list[tuple[int, int, int]] = []

        def _mark(self, trainer: Any) -> None:
            self.stamps.append(time.perf_counter())
            stats = trainer.strategy.comm_stats
            # DDP's latest sampled synchronised iteration: with a sample every iteration (AccelDDP's default on
            # CPU) it lags the true count by one at every mark alike, so differences count DDP's rounds exactly.
            iteration = int(ddp_logging_data(trainer.strategy.model).get("iteration", 0))
            self.counts.append((stats.calls, stats.bytes, iteration))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % k == 0:
                self._mark(trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._mark(trainer)

    clock = StepClock()
    module = _common.classifier(build_net(args.model), lambda params: torch.optim.AdamW(params, lr=args.lr))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=AccelDDP(sync_batchnorm=False, comm_hook="bf16" if arm == "accel_ddp_bf16" else None),
        accumulate_grad_batches=k,
        callbacks=[clock],
        max_steps=args.warmup + args.steps,
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=loader)
    return {"stamps": clock.stamps, "counts": clock.counts, "params": _flat_params(module.net)}


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    """Every process: for each k, all arms interleaved ``args.reps`` times."""
    out: dict[str, Any] = {}
    for k in args.k:
        loader = make_loader(rank, world_size, args.batch, (args.warmup + args.steps) * k)
        times: dict[str, list[float]] = {arm: [] for arm in args.arms}
        per_step: dict[str, tuple[float, ...]] = {}
        final: dict[str, torch.Tensor] = {}
        for rep in range(args.reps):
            for arm in _common.rotated(args.arms, rep):
                dist.barrier()
                if arm in ("naive", "raw_no_sync"):
                    run = run_raw(arm, k, args, loader)
                else:
                    run = run_trainer(arm, k, args, loader, world_size)
                stamps, counts = run["stamps"], run["counts"]
                w, n = args.warmup, args.steps
                times[arm].append((stamps[w + n] - stamps[w]) / n)
                per_step[arm] = tuple((counts[w + n][i] - counts[w][i]) / n for i in range(3))
                final[arm] = run["params"]
        reference = final.get("naive", next(iter(final.values())))
        out[str(k)] = {
            "time_s": {arm: _common.slowest_rank(v) for arm, v in times.items()},
            "calls_bytes_per_step": per_step,
            "max_param_diff_vs_naive": {arm: float((p - reference).abs().max()) for arm, p in final.items()},
        }
    out["params"] = sum(p.numel() for p in build_net(args.model).parameters())
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("accumulation", __doc__)
    p.add_argument("--k", type=_common.positive_int, nargs="+", default=[1, 2, 4, 8], help="accumulation steps")
    p.add_argument("--model", choices=("mlp", "tiny"), default="mlp", help="benchmark model")
    p.add_argument("--batch", type=_common.positive_int, default=8, help="micro-batch per process")
    p.add_argument("--steps", type=_common.positive_int, default=6, help="timed optimizer steps per repetition")
    p.add_argument("--warmup", type=_common.positive_int, default=2, help="untimed optimizer steps per repetition")
    p.add_argument("--reps", type=_common.positive_int, default=5, help="interleaved repetitions")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--world-size", type=_common.positive_int, default=2, help="processes")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms) or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: expected distinct names from {', '.join(ARMS)}")
    if args.tiny:
        args.model, args.k, args.steps, args.warmup, args.reps, args.batch = "tiny", [2], 2, 1, 1, 2

    machine = _common.machine_info()
    start = time.perf_counter()
    ranks = _common.launch(worker, args.world_size, args)
    wall = time.perf_counter() - start
    r0 = ranks[0]
    params = r0["params"]
    round_bytes = {"fp32": 4 * params, "bf16": 2 * params}
    per_k: dict[str, Any] = {}
    rows = []
    for k in args.k:
        res = r0[str(k)]
        entry: dict[str, Any] = {}
        naive_times = res["time_s"].get("naive")
        for arm in args.arms:
            calls, nbytes, ddp_iterations = res["calls_bytes_per_step"][arm]
            expected_rounds = k if arm == "naive" else 1
            expected = expected_rounds * round_bytes["bf16" if arm == "accel_ddp_bf16" else "fp32"]
            ms = [1e3 * t for t in res["time_s"][arm]]
            e: dict[str, Any] = {
                "allreduce_calls_per_step": calls,
                "allreduce_bytes_per_step": nbytes,
                "expected_bytes_per_step": expected,
                "allreduce_mb_per_step": round(nbytes / 1e6, 3),
                # DDP's own count (only meaningful where DDP samples every iteration: the hookless arm on CPU)
                "ddp_sync_iterations_per_step": ddp_iterations if arm == "accel_ddp" else None,
                "step_ms": _common.summarize(ms, 2),
                "max_param_diff_vs_naive": res["max_param_diff_vs_naive"][arm],
            }
            if naive_times is not None and arm != "naive":
                saved = [1e3 * (a - b) for a, b in zip(naive_times, res["time_s"][arm])]
                e["saved_ms_per_step_vs_naive"] = _common.summarize(saved, 2)
                e["speedup_vs_naive"] = _common.summarize(_common.paired_ratios(naive_times, res["time_s"][arm]), 3)
            entry[arm] = e
            rows.append([
                k, arm, f"{calls:g}", f"{ddp_iterations:g}" if arm == "accel_ddp" else "", f"{nbytes / 1e6:.2f}",
                f"{expected / 1e6:.2f}", f"{e['step_ms']['median']:.1f}",
                f"{e['step_ms']['q1']:.1f}-{e['step_ms']['q3']:.1f}",
                f"{e['saved_ms_per_step_vs_naive']['median']:+.1f}" if "saved_ms_per_step_vs_naive" in e else "",
                f"{e['speedup_vs_naive']['median']:.3f}" if "speedup_vs_naive" in e else "",
                f"{e['max_param_diff_vs_naive']:.1e}",
            ])  # fmt: skip
        per_k[str(k)] = entry
    result = {
        "benchmark": "accumulation",
        "command": _common.command_line("accumulation.py", argv),
        "machine": machine,
        "load_average_after": _common.load_average(),
        "wall_s": round(wall, 1),
        "setup": {
            "model": f"{args.model} MLP {IN_FEATURES}-...-10",
            "parameters": params,
            "fp32_gradient_bytes": round_bytes["fp32"],
            "micro_batch_per_process": args.batch,
            "world_size": args.world_size,
            "backend": "gloo",
            "threads_per_process": 1,
            "precision": "fp32",
            "optimizer": f"AdamW(lr={args.lr})",
            "timed_steps_per_rep": args.steps,
            "warmup_steps_per_rep": args.warmup,
            "reps": args.reps,
        },
        "per_k": per_k,
    }
    table = _common.markdown_table(
        ["k", "arm", "all-reduce calls / step", "DDP sync iterations / step", "MB / step", "expected MB / step",
         "median step (ms)",
         "IQR (ms)", "saved vs naive (ms)", "speed-up vs naive", "max weight diff vs naive"],
        rows,
    )  # fmt: skip
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
