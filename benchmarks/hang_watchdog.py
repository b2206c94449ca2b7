"""Per-step overhead of HangWatchdog (and of the Lightning-free ProgressWatchdog) over no watchdog, in one run.

Two CPU processes joined by gloo (``launch`` in ``_common.py``) train the same small MLP with SGD under DDP on one batch
made once (``RepeatBatch``), in two designs, all interleaved in the same processes:

* **blocks** (the headline): one fit (or raw loop) per repetition whose steps alternate between blocks of
  ``--block`` steps with and without the watchdog's per-step work. A tiny callback removes ``HangWatchdog`` from
  ``trainer.callbacks`` and puts it back, so Lightning's dispatch of its hooks is included; the raw loop switches its
  ``ProgressWatchdog.enter`` calls on and off. Adjacent blocks are paired (on / off), their order alternates, and the
  median over all pairs is the ratio. The watchdog thread runs through the whole fit: its cost is reported as the CPU
  time it used per second.
* **fits**: fresh fits ``off`` (``Trainer(strategy=DDPStrategy())``) and ``on`` (``+ HangWatchdog(timeout=30)``),
  and raw loops ``raw_off`` / ``raw_on``, in rotated order; paired per repetition. Their spread shows how much a
  fresh fit varies on the machine.

Step times are the periods between host-clock stamps at the start of every step, on the slowest rank. Blocks use the
mean step of a block (wall clock, and this process's CPU time, which waiting for a busy core does not inflate); fits
the median step of a fit (robust to a step stalled by another process). Also reported, deterministic: one
``enter()`` call, one read of the training loop's position (by the thread, once per interval), and the watchdog
thread's CPU time per second of training.

Run (from the repository root)::

    python benchmarks/hang_watchdog.py                 # writes benchmarks/results/hang_watchdog.json (+ .md)
    python benchmarks/hang_watchdog.py --tiny          # a few seconds: checks that it runs
"""

from __future__ import annotations

import itertools
import statistics
import time
import timeit
from typing import Any

import _common
import torch
import torch.nn.functional as F
from torch import nn

FITS = ("off", "on", "raw_off", "raw_on")
BLOCKS = ("blocks", "raw_blocks")
ARMS = (*FITS, *BLOCKS)
PAIRS = (("on", "off"), ("raw_on", "raw_off"))


def build_net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(256, width), nn.GELU(), nn.Linear(width, 10))


def make_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _thread_cpu_s(thread: Any) -> float:
    """CPU seconds used so far by ``thread`` (Linux: its pthread CPU clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) if thread is not None else 0.0


def _noop(phase: str, step: int | None = None) -> None:
    pass


def _block_on(step: int, args: Any, rep: int) -> bool:
    """Whether the watchdog's per-step work runs at ``step`` of a blocks run (order alternates by repetition)."""
    return step >= args.warmup and ((step - args.warmup) // args.block + rep) % 2 == 1


def run_raw(arm: str, args: Any, rep: int) -> tuple[list[float], list[float], list[bool], float]:
    """A raw DDP loop; returns step-start stamps (wall, process CPU), per-step watchdog flags, thread CPU seconds."""
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.meters import ProgressWatchdog

    model = DistributedDataParallel(build_net(args.width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watchdog = ProgressWatchdog(30.0) if arm in ("raw_on", "raw_blocks") else None
    if watchdog is not None:
        watchdog.start()
    x, y = make_batch(args.batch)
    stamps, cpu, flags = [], [], []
    for step in range(_steps(arm, args) + 1):
        on = arm == "raw_on" or (arm == "raw_blocks" and _block_on(step, args, rep))
        enter = watchdog.enter if on else _noop
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        flags.append(on)
        enter("forward", step)
        loss = F.cross_entropy(model(x), y)
        enter("backward", step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        enter("optimizer_step", step)
        opt.step()
        enter("data", step + 1)
    thread_cpu = _thread_cpu_s(getattr(watchdog, "_thread", None))
    if watchdog is not None:
        watchdog.stop()
    return stamps, cpu, flags, thread_cpu


def _steps(arm: str, args: Any) -> int:
    return args.warmup + (2 * args.block * args.pairs if arm.endswith("blocks") else args.steps)


def run_trainer(arm: str, args: Any, rep: int, world_size: int) -> tuple[list[float], list[float], list[bool], float]:
    """One Lightning fit of the arm; returns step-start stamps (wall, CPU), per-step watchdog flags, thread CPU."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lit_accel.callbacks.hang_watchdog import HangWatchdog

    watchdog = HangWatchdog(timeout=30.0) if arm in ("on", "blocks") else None

    class StepClock(Callback):
        """Stamps every step; in a blocks run, adds or removes the watchdog from the callbacks between steps."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []
            self.flags: list[bool] = []
            self.thread_cpu = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.stamps.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.flags.append(watchdog is not None and watchdog in trainer.callbacks)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if arm == "blocks":
                wanted, present = _block_on(batch_idx + 1, args, rep), watchdog in trainer.callbacks
                if wanted and not present:
                    trainer.callbacks.append(watchdog)
                elif present and not wanted:
                    trainer.callbacks.remove(watchdog)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # before the watchdog's: its thread still runs
            if watchdog is not None:
                self.thread_cpu = _thread_cpu_s(watchdog.watchdog._thread)
                if watchdog not in trainer.callbacks:
                    trainer.callbacks.append(watchdog)  # so that it stops its thread

    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(),
        callbacks=[clock] + ([watchdog] if watchdog is not None else []),
        max_steps=_steps(arm, args) + 1,
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    module = _common.classifier(build_net(args.width), lambda params: torch.optim.SGD(params, lr=0.01))
    trainer.fit(module, train_dataloaders=_common.RepeatBatch(make_batch(args.batch), _steps(arm, args) + 1))
    return clock.stamps, clock.cpu, clock.flags, clock.thread_cpu


def _block_pairs(periods: list[float], flags: list[bool], args: Any) -> list[tuple[float, float]]:
    """(mean with, mean without the watchdog) for each adjacent pair of blocks; ``periods[i]`` starts at step ``i``."""
    pairs = []
    for pair in range(args.pairs):
        window = range(args.warmup + 2 * pair * args.block, args.warmup + 2 * (pair + 1) * args.block)
        on = statistics.fmean(periods[i] for i in window if flags[i])
        pairs.append((on, statistics.fmean(periods[i] for i in window if not flags[i])))
    return pairs


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    """Runs in every process: all arms, interleaved, ``args.reps`` times."""
    import torch.distributed as dist

    steps: dict[str, list[float]] = {arm: [] for arm in FITS}
    cpu: dict[str, list[float]] = {arm: [] for arm in FITS}
    blocks: dict[str, dict[str, list[tuple[float, float]]]] = {arm: {"wall": [], "cpu": []} for arm in BLOCKS}
    thread_cpu_per_s: dict[str, list[float]] = {arm: [] for arm in ("on", "raw_on", *BLOCKS)}
    for rep in range(args.reps):
        for arm in _common.rotated(ARMS, rep):
            dist.barrier()
            if arm.startswith("raw"):
                stamps, cpu_stamps, flags, thread_cpu = run_raw(arm, args, rep)
            else:
                stamps, cpu_stamps, flags, thread_cpu = run_trainer(arm, args, rep, world_size)
            if arm in thread_cpu_per_s:
                thread_cpu_per_s[arm].append(thread_cpu / max(stamps[-1] - stamps[0], 1e-9))
            if arm in BLOCKS:  # wall: step by step the slowest rank's period (DDP keeps the ranks in lockstep)
                periods = _common.slowest_rank([b - a for a, b in itertools.pairwise(stamps)])
                blocks[arm]["wall"] += _block_pairs(periods, flags, args)
                cpu_periods = [b - a for a, b in itertools.pairwise(cpu_stamps)]  # this rank's CPU time
                blocks[arm]["cpu"] += _block_pairs(cpu_periods, flags, args)
                continue
            timed = stamps[args.warmup : args.warmup + args.steps + 1]
            steps[arm] += [b - a for a, b in itertools.pairwise(timed)]
            cpu[arm].append(_common.mean_period(cpu_stamps, args.warmup, args.steps))
    return {
        "steps": {arm: _common.slowest_rank(v) for arm, v in steps.items()},
        "cpu": {arm: _common.slowest_rank(v) for arm, v in cpu.items()},
        "blocks": blocks,
        "thread_cpu_per_s": {arm: _common.slowest_rank(v) for arm, v in thread_cpu_per_s.items()},
    }


def enter_cost_ns(calls: int = 200_000) -> float:
    """Nanoseconds per ``ProgressWatchdog.enter`` call on the main thread (the watchdog need not run for this)."""
    from lit_accel.meters import ProgressWatchdog

    watchdog = ProgressWatchdog(30.0)
    best = min(timeit.repeat(lambda: watchdog.enter("forward", 3, 30.0), number=calls, repeat=5))
    return 1e9 * best / calls


def position_cost_us(reads: int = 50_000) -> float:
    """Microseconds per read of the training loop's position (its progress counters), a real Trainer.

    The watchdog's thread reads it once per ``interval``; the main thread runs no HangWatchdog code per training batch
    (Lightning skips its idle hooks). Deterministic, unlike the step ratios.
    """
    import lightning.pytorch as pl

    from lit_accel.callbacks.hang_watchdog import HangWatchdog

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    watchdog = HangWatchdog(timeout=30.0)
    watchdog._trainer = trainer  # as after on_fit_start, without starting the thread
    return 1e6 * min(timeit.repeat(watchdog._position, number=reads, repeat=5)) / reads


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("hang_watchdog", __doc__)
    p.add_argument("--width", type=_common.positive_int, default=256, help="hidden width of the MLP")
    p.add_argument("--batch", type=_common.positive_int, default=32, help="samples per process")
    p.add_argument("--block", type=_common.positive_int, default=50, help="steps per block (blocks design)")
    p.add_argument("--pairs", type=_common.positive_int, default=6, help="on/off block pairs per fit (blocks)")
    p.add_argument("--steps", type=_common.positive_int, default=300, help="timed steps per fit (fits design)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each fit")
    p.add_argument("--reps", type=_common.positive_int, default=6, help="interleaved repetitions of every arm")
    p.add_argument("--world-size", type=_common.positive_int, default=2, help="processes")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes: a few steps, 2 repetitions")
    args = p.parse_args(argv)
    if args.tiny:
        args.block, args.pairs, args.steps, args.warmup, args.reps = 5, 2, 20, 2, 2

    machine = _common.machine_info()
    start = time.perf_counter()
    ranks = _common.launch(worker, args.world_size, args)
    wall = time.perf_counter() - start
    r0, n = ranks[0], args.steps
    per_rep = {}
    for arm in FITS:
        reps = [r0["steps"][arm][i * n : (i + 1) * n] for i in range(args.reps)]
        per_rep[arm] = {"median": [statistics.median(r) for r in reps], "cpu": r0["cpu"][arm]}
    fits = {
        arm: {
            "median_step_ms": _common.summarize([1e3 * v for v in r["median"]], 4),
            "cpu_ms_per_step": _common.summarize([1e3 * v for v in r["cpu"]], 4),
        }
        for arm, r in per_rep.items()
    }
    fit_ratios = {
        f"{num}/{den}": {
            kind: _common.summarize(_common.paired_ratios(per_rep[num][kind], per_rep[den][kind]), 4)
            for kind in ("median", "cpu")
        }
        for num, den in PAIRS
    }
    block_ratios = {
        arm: {
            "wall": _common.summarize([on / off for on, off in r0["blocks"][arm]["wall"]], 4),
            "cpu": _common.summarize([on / off for on, off in r0["blocks"][arm]["cpu"]], 4),
            "cpu_added_us_per_step": _common.summarize([1e6 * (on - off) for on, off in r0["blocks"][arm]["cpu"]], 2),
        }
        for arm in BLOCKS
    }
    thread = {arm: _common.summarize([1e3 * v for v in values], 4) for arm, values in r0["thread_cpu_per_s"].items()}
    result: dict[str, Any] = {
        "benchmark": "hang_watchdog",
        "command": _common.command_line("hang_watchdog.py", argv),
        "machine": machine,
        "load_average_after": _common.load_average(),
        "wall_s": round(wall, 1),
        "setup": {
            "model": f"MLP 256-{args.width}-10, SGD, DDPStrategy()",
            "batch_per_process": args.batch,
            "world_size": args.world_size,
            "backend": "gloo",
            "threads_per_process": 1,
            "watchdog": "HangWatchdog(timeout=30) / ProgressWatchdog(30): interval 1 s, TCP-store side channel",
            "blocks": f"{args.pairs} pairs of {args.block}-step blocks per fit after {args.warmup} warm-up steps",
            "fits": f"{args.steps} timed steps per fit after {args.warmup} warm-up steps",
            "reps": args.reps,
            "arms_in_order": [_common.rotated(ARMS, r) for r in range(min(args.reps, len(ARMS)))],
        },
        "overhead_ratio": block_ratios["blocks"]["wall"]["median"],
        "overhead_ratio_cpu_time": block_ratios["blocks"]["cpu"]["median"],
        "cpu_added_us_per_step": block_ratios["blocks"]["cpu_added_us_per_step"]["median"],
        "raw_overhead_ratio": block_ratios["raw_blocks"]["wall"]["median"],
        "block_ratios": block_ratios,
        "fit_ratios": fit_ratios,
        "fits": fits,
        "watchdog_thread_cpu_ms_per_s": thread,
        "enter_ns": round(enter_cost_ns(), 1),
        "position_read_us": round(position_cost_us(), 2),
        "per_pair_ms": {
            arm: {
                kind: [[round(1e3 * on, 4), round(1e3 * off, 4)] for on, off in v]
                for kind, v in r0["blocks"][arm].items()
            }
            for arm in BLOCKS
        },
        "per_rep_ms": {arm: {k: [round(1e3 * v, 4) for v in vs] for k, vs in r.items()} for arm, r in per_rep.items()},
    }

    def cell(stats: dict[str, float], fmt: str) -> str:
        return f"{stats['median']:{fmt}} ({stats['q1']:{fmt}}-{stats['q3']:{fmt}}, n={stats['n']})"

    names = {"blocks": "HangWatchdog (Lightning, DDPStrategy)", "raw_blocks": "ProgressWatchdog.enter (raw DDP loop)"}
    table = _common.markdown_table(
        ["blocks: watchdog on / off, adjacent blocks", "wall-clock ratio", "CPU-time ratio", "CPU added (µs/step)"],
        [[names[arm], cell(r["wall"], ".4f"), cell(r["cpu"], ".4f"), cell(r["cpu_added_us_per_step"], ".1f")]
         for arm, r in block_ratios.items()],
    )  # fmt: skip
    table += "\n" + _common.markdown_table(
        ["fits: arm", "median step (ms)", "CPU / step (ms)"],
        [[arm, cell(f["median_step_ms"], ".3f"), cell(f["cpu_ms_per_step"], ".3f")] for arm, f in fits.items()],
    )
    table += "\n" + _common.markdown_table(
        ["fits: paired ratio", "median step", "CPU time"],
        [[name, cell(r["median"], ".4f"), cell(r["cpu"], ".4f")] for name, r in fit_ratios.items()],
    )
    table += "\n" + _common.markdown_table(
        ["", ""],
        [["overhead ratio (blocks, HangWatchdog on / off, wall clock)", f"{result['overhead_ratio']:.4f}"],
         ["overhead ratio (blocks, CPU time)", f"{result['overhead_ratio_cpu_time']:.4f}"],
         ["watchdog thread CPU per second of training (Lightning blocks arm)", f"{thread['blocks']['median']:.3f} ms"],
         ["ProgressWatchdog.enter() per call", f"{result['enter_ns']:.0f} ns"],
         ["a read of the training loop's position (thread, per interval)", f"{result['position_read_us']:.2f} µs"]],
    )  # fmt: skip
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
