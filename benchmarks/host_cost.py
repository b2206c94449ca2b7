"""Per-step host cost of lit_accel over Lightning, resolved on a near-null model: CPU and wall ms per optimizer step.

The model is ``Linear(8, 8)`` at batch 4 per process, so a step is almost all framework: Lightning's loop, the
strategy, the precision plugin, the callbacks, DDP and gloo. One process and two (``--world-sizes``), gloo, one intra-op
thread each. Each fit runs ``--warmup + --steps + 1`` steps over one batch made once (``RepeatBatch``) and is timed
over the ``--steps`` steps after the warm-up in blocks of ``--log-every`` steps (a block holds the same work, one
logging step included).

``--design paired`` (the default) resolves about 0.01-0.02 ms. This VM's speed changes by 20-30 % within seconds, so
two fits timed one after the other differ by more than the limits; instead an arm and its reference run **in turns**
in two threads of the same processes, one step each (``_lockstep.py``): their block ``k`` runs within a millisecond of
each other. Per pair and repetition the figure is the median over blocks of (arm's block - reference's block) in
**CPU time of the fit's own thread** (``time.thread_time``: its Python and its kernels; not the background threads of
gloo or the watchdog, which wake once a second); which one goes first alternates by repetition, the pairs rotate, and
the tables give the median and IQR over ``--reps`` repetitions of the mean over ranks. Each arm is paired with its
baseline and with the arm it adds one thing to. ``ddp_again - ddp`` (Lightning against itself) is the design's noise
floor, to read every other difference against. ``--design sequential``, the earlier design, times whole fits one
after the other (arms interleaved and rotated): CPU time of every thread of the process (``process_time``) and wall
time, block medians (``*_mean_ms``: the plain means); its differences move by 0.1-0.2 ms run to run here.

Arms (``--arms``; every DDP gets ``gradient_as_bucket_view=True``, AccelDDP's default, so only Python work differs):

* ``ddp``: ``DDPStrategy``, fp32 (Lightning's own); ``ddp_again``: the same, a second time (the noise floor).
  ``ddp_fp16``: ``DDPStrategy`` +
  ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``;
* ``accel_ddp``: ``AccelDDP()`` as shipped (report-only HangWatchdog thread);
  ``accel_ddp_no_watchdog``: the same with a benchmark-only ``HangWatchdog`` that never starts (lit_accel has no
  switch to turn the default watchdog off: this arm bounds what it costs);
* ``ddp_callback``: ``DDPStrategy`` + an empty ``Callback()``: what Lightning's dispatch of one callback's hooks costs;
* ``ddp_guard``: ``DDPStrategy`` + ``NonFiniteGuard()``, fp32;
* ``accel_fp16``: ``AccelDDP()`` + ``AccelPrecision("16-mixed")``, the default stack; ``accel_fp16_loss_scale``,
  ``accel_fp16_efficiency``, ``accel_fp16_memory``: the same + one monitor; ``full``: + the three monitors.

``--profile`` runs each arm once, one process, with ``cProfile`` over ``--profile-steps`` steps and a dispatch-mode
op counter over as many more: Python calls and ATen ops per step, and the functions where an arm spends more than its
baseline (deterministic counts; the times are cProfile's, inflated).

Run (from the repository root; the lead's command on a quiet machine)::

    python benchmarks/host_cost.py                     # every pair, 1 and 2 processes, 7 reps (~25 min on 2 cores)
    python benchmarks/host_cost.py --arms ddp,ddp_again,accel_ddp,ddp_fp16,accel_fp16,full --reps 12  # limits, 13 min
    python benchmarks/host_cost.py --profile --out benchmarks/results/host_cost_profile.json
    python benchmarks/host_cost.py --tiny              # smoke test
"""

from __future__ import annotations

import cProfile
import gc
import itertools
import pstats
import statistics
import time
from collections import Counter
from typing import Any

import _common
import _lockstep
import torch
from _host_cost_report import acceptance, row, tables

MONITORS = ("loss_scale", "efficiency", "memory")
#: arm -> (baseline it is compared with, the arm it adds one thing to, or None)
ARMS: dict[str, tuple[str | None, str | None]] = {
    "ddp": (None, None),
    "ddp_again": ("ddp", "ddp"),
    "accel_ddp": ("ddp", "ddp"),
    "accel_ddp_no_watchdog": ("ddp", "ddp"),
    "ddp_callback": ("ddp", "ddp"),
    "ddp_guard": ("ddp", "ddp"),
    "ddp_fp16": (None, None),
    "accel_fp16": ("ddp_fp16", "ddp_fp16"),
    **{f"accel_fp16_{m}": ("ddp_fp16", "accel_fp16") for m in MONITORS},
    "full": ("ddp_fp16", "accel_fp16"),
}
_KEYS = ("cpu_ms", "wall_ms", "cpu_mean_ms", "wall_mean_ms")


def build(arm: str) -> tuple[Any, list[Any], list[Any]]:
    """``(strategy, plugins, callbacks)`` of an arm."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor, MemoryMonitor, NonFiniteGuard
    from lit_accel.callbacks.hang_watchdog import HangWatchdog

    class NoWatchdog(HangWatchdog):  # never starts: AccelDDP adds none beside it (a user's own wins)
        def on_fit_start(self, *args: Any) -> None:
            pass

    monitors = {
        "loss_scale": LossScaleMonitor,
        "efficiency": lambda: EfficiencyMonitor(print_summary=False),
        "memory": lambda: MemoryMonitor(print_summary=False),
    }
    if arm.startswith("ddp"):
        strategy: Any = DDPStrategy(gradient_as_bucket_view=True)
    else:
        strategy = AccelDDP()
    fp16 = "fp16" in arm or arm == "full"
    plugins: list[Any] = []
    if fp16 and arm.startswith("ddp"):
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    elif fp16:
        plugins = [AccelPrecision("16-mixed")]
    callbacks: list[Any] = []
    if arm == "ddp_callback":
        callbacks.append(Callback())
    if arm == "accel_ddp_no_watchdog":
        callbacks.append(NoWatchdog())
    if arm == "ddp_guard":
        callbacks.append(NonFiniteGuard())
    names = MONITORS if arm == "full" else [m for m in MONITORS if arm.endswith(m)]
    callbacks += [monitors[m]() for m in names]
    return strategy, plugins, callbacks


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def fit(
    arm: str, args: Any, world_size: int, profile: bool = False, turns: _lockstep.Turns | None = None, me: int = 0
) -> dict[str, Any]:
    """One fit of ``arm``; CPU and wall ms per step over the timed steps (and, with ``profile``, the counts).

    With ``turns`` it runs in turns with another fit, a step each, and its CPU time is its own thread's.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    first, last, block = args.warmup, args.warmup + args.steps, args.log_every
    marks: dict[int, tuple[float, float]] = {}
    tools: dict[str, Any] = {}
    cpu_clock = time.process_time if turns is None else time.thread_time

    class StepClock(Callback):  # in every arm alike: two integer comparisons per step outside its marks
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if first <= batch_idx <= last and (batch_idx - first) % block == 0:
                marks[batch_idx] = (time.perf_counter(), cpu_clock())
            if turns is not None:
                turns.hand_over(me)
            if not profile:
                return
            if batch_idx == first:
                tools["profiler"] = cProfile.Profile()
                tools["profiler"].enable()
            elif batch_idx == last:
                tools["profiler"].disable()
                tools["ops"] = OpCounter().__enter__()  # LIFO with no other mode: nothing else pushes one per step
            elif batch_idx == last + args.steps:
                tools["ops"].__exit__(None, None, None)

    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    module = _common.classifier(net, lambda params: torch.optim.SGD(params, lr=1e-3))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(args.batch, 8, generator=g), torch.randint(0, 8, (args.batch,), generator=g))
    strategy, plugins, callbacks = build(arm)
    steps = last + 1 + (args.steps if profile else 0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        plugins=plugins,
        callbacks=[StepClock(), *callbacks],
        max_steps=steps,
        log_every_n_steps=args.log_every,
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=_common.RepeatBatch(batch, steps))
    (w0, c0), (w1, c1) = marks[first], marks[last]
    ends = sorted(marks)
    blocks = [(b - a, marks[b], marks[a]) for a, b in itertools.pairwise(ends) if b - a == block]  # whole blocks only
    out: dict[str, Any] = {
        "cpu_blocks_ms": [1e3 * (c - d) / n for n, (_, c), (_, d) in blocks],
        "wall_ms": 1e3 * statistics.median((w - v) / n for n, (w, _), (v, _) in blocks),
        "cpu_ms": 1e3 * statistics.median((c - d) / n for n, (_, c), (_, d) in blocks),
        "wall_mean_ms": 1e3 * (w1 - w0) / args.steps,
        "cpu_mean_ms": 1e3 * (c1 - c0) / args.steps,
    }
    if profile:
        out["functions"] = _functions(tools["profiler"], args.steps)
        out["ops"] = {op: n / args.steps for op, n in tools["ops"].ops.items()}
    return out


def _functions(profiler: cProfile.Profile, steps: int) -> dict[str, tuple[float, float, float]]:
    """``"file:line(name)" -> (calls, own us, cumulative us)`` per step, paths relative to site-packages or the repo."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    out = {}
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        for root in ("site-packages/", str(_common.REPO_ROOT) + "/", "/lib/python3"):
            if root in path:
                path = path.split(root, 1)[1]
                break
        out[f"{path}:{line}({name})"] = (calls / steps, 1e6 * own / steps, 1e6 * cumulative / steps)
    return out


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    """In every process: each arm ``--reps`` times, interleaved and rotated."""
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in args.arms}
    for rep in range(args.reps):
        for arm in _common.rotated(args.arms, rep):
            torch.distributed.barrier()
            results[arm].append(fit(arm, args, world_size))
    return results


def pairs(arms: list[str]) -> list[tuple[str, str]]:
    """``(arm, reference)`` for every arm and each of its baseline and parent among ``arms``."""
    return [(arm, ref) for arm in arms for ref in dict.fromkeys(ARMS[arm]) if ref is not None and ref in arms]


def paired_worker(rank: int, world_size: int, args: Any) -> dict[str, list[dict[str, float]]]:
    """In every process: each pair ``--reps`` times, rotated; the two fits of a pair run in turns, a step each.

    Per pair and repetition: the median over blocks of (arm's block - reference's block), blocks paired by index, and
    each fit's own block median. Which of the two goes first alternates between repetitions.
    """
    results: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for arm, ref in _common.rotated(pairs(args.arms), rep):
            gc.collect()  # the previous pair's garbage is not collected inside this one
            torch.distributed.barrier()
            order = (arm, ref) if rep % 2 else (ref, arm)
            jobs = [lambda turns, me, a=a: fit(a, args, world_size, turns=turns, me=me) for a in order]
            runs = dict(zip(order, _lockstep.run_in_turns(jobs)))
            diffs = [a - b for a, b in zip(runs[arm]["cpu_blocks_ms"], runs[ref]["cpu_blocks_ms"])]
            own = {"arm_cpu_ms": runs[arm]["cpu_ms"], "ref_cpu_ms": runs[ref]["cpu_ms"]}
            results.setdefault(f"{arm} - {ref}", []).append({"cpu_ms": statistics.median(diffs), **own})
    return results


def measure_paired(args: Any, world_size: int) -> dict[str, Any]:
    ranks = _common.launch(paired_worker, world_size, args, timeout=6 * 3600)
    differences = {
        name: {key: _common.summarize([statistics.fmean(r[name][i][key] for r in ranks) for i in range(args.reps)], 4)
               for key in ("cpu_ms", "arm_cpu_ms", "ref_cpu_ms")}
        for name in ranks[0]
    }  # fmt: skip
    per_rank = {name: [[round(x["cpu_ms"], 4) for x in r[name]] for r in ranks] for name in ranks[0]}
    return {"differences": differences, "acceptance": acceptance(differences), "per_rank_cpu_ms": per_rank}


def profile_worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    return {arm: fit(arm, args, world_size, profile=True) for arm in args.arms}


def measure(args: Any, world_size: int) -> dict[str, Any]:
    ranks = _common.launch(worker, world_size, args, timeout=6 * 3600)
    per_rep = {
        arm: {key: [statistics.fmean(r[arm][i][key] for r in ranks) for i in range(args.reps)]
              for key in _KEYS}
        for arm in args.arms
    }  # fmt: skip
    arms = {arm: {key: _common.summarize(v, 4) for key, v in values.items()} for arm, values in per_rep.items()}
    differences: dict[str, Any] = {}
    for arm, (baseline, parent) in ARMS.items():
        for ref in dict.fromkeys(x for x in (baseline, parent) if x is not None and x in per_rep):
            if arm in per_rep:
                differences[f"{arm} - {ref}"] = {
                    key: _common.summarize([a - b for a, b in zip(per_rep[arm][key], per_rep[ref][key])], 4)
                    for key in _KEYS
                }
    per_rank = {arm: [[round(x["cpu_ms"], 4) for x in r[arm]] for r in ranks] for arm in args.arms}
    return {
        "arms": arms,
        "differences": differences,
        "acceptance": acceptance(differences),
        "per_rank_cpu_ms": per_rank,
    }


def profile(args: Any) -> dict[str, Any]:
    """One process: Python calls and ATen ops per step per arm, and the functions that cost more than the baseline."""
    runs = _common.launch(profile_worker, 1, args)[0]
    out: dict[str, Any] = {}
    for arm, run in runs.items():
        fns = run["functions"]
        entry: dict[str, Any] = {
            "python_calls_per_step": round(sum(c for c, _, _ in fns.values()), 1),
            "aten_ops_per_step": round(sum(run["ops"].values()), 2),
            "cprofile_us_per_step": round(sum(own for _, own, _ in fns.values()), 1),
        }
        baseline = ARMS[arm][0]
        if baseline is not None and baseline in runs:
            base = runs[baseline]["functions"]
            base_calls, base_ops = sum(c for c, _, _ in base.values()), runs[baseline]["ops"]
            entry["extra_python_calls_per_step"] = round(entry["python_calls_per_step"] - base_calls, 1)
            entry["extra_aten_ops"] = {op: round(n - base_ops.get(op, 0.0), 2) for op, n in run["ops"].items()
                                       if n - base_ops.get(op, 0.0) > 0.005}  # fmt: skip
            extra = {name: (c - base.get(name, (0, 0, 0))[0], own - base.get(name, (0, 0, 0))[1], cum)
                     for name, (c, own, cum) in fns.items()}  # fmt: skip
            own_top = sorted(extra.items(), key=lambda kv: -kv[1][1])[: args.top]
            ours = sorted(((n, v) for n, v in extra.items() if n.startswith("lit_accel/") and v[0] > 0.005),
                          key=lambda kv: -kv[1][2])[: args.top]  # fmt: skip
            entry["extra_own_time"] = [row(n, v) for n, v in own_top if v[1] > 0.5]
            by_calls = sorted(extra.items(), key=lambda kv: -kv[1][0])[: 2 * args.top]
            entry["extra_calls"] = [row(n, v) for n, v in by_calls if v[0] > 0.005]
            entry["lit_accel_cumulative"] = [row(n, v) for n, v in ours]
        out[arm] = entry
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("host_cost", __doc__)
    p.add_argument("--world-sizes", type=_common.positive_int, nargs="+", default=[1, 2], help="processes per run")
    p.add_argument("--warmup", type=_common.positive_int, default=200, help="untimed steps at the start of each fit")
    p.add_argument("--steps", type=_common.positive_int, default=1500, help="timed optimizer steps per fit")
    p.add_argument("--reps", type=_common.positive_int, default=7, help="interleaved repetitions of every arm")
    p.add_argument("--batch", type=_common.positive_int, default=4, help="samples per process")
    p.add_argument("--log-every", type=_common.positive_int, default=50, help="Trainer(log_every_n_steps=)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument(
        "--design",
        choices=("paired", "sequential"),
        default="paired",
        help="paired: each arm and its reference in turns, a step each (resolves ~0.01 ms on a noisy VM);"
        " sequential: one fit after the other, interleaved and rotated (CPU of every thread, and wall)",
    )
    p.add_argument("--profile", action="store_true", help="profile each arm once (1 process) instead of timing")
    p.add_argument("--top", type=_common.positive_int, default=12, help="--profile: functions listed per arm")
    p.add_argument("--note", default="measured under load by other jobs", help="what the tables say about the machine")
    p.add_argument("--tiny", action="store_true", help="smoke test: 1 process, 10 + 30 steps, 1 repetition")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if any(a not in ARMS for a in args.arms) or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: expected distinct names from {', '.join(ARMS)}")
    if args.tiny:
        args.world_sizes, args.warmup, args.steps, args.reps, args.log_every = [1], 10, 30, 1, 10
    if args.steps < args.log_every:
        p.error(f"--steps {args.steps}: at least one block of --log-every {args.log_every} steps is timed")
    if args.profile:
        args.steps = min(args.steps, 500)
    machine = _common.machine_info()
    start = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "host_cost", "command": _common.command_line("host_cost.py", argv),
                              "machine": machine, "note": args.note}  # fmt: skip
    if args.profile:
        result["profile"] = profile(args)
    else:
        run = measure_paired if args.design == "paired" else measure
        result["world_sizes"] = {str(n): run(args, n) for n in args.world_sizes}
    result["load_average_after"] = _common.load_average()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["setup"] = {
        "model": "Linear(8, 8), cross-entropy, SGD(lr=1e-3)", "batch_per_process": args.batch, "backend": "gloo",
        "threads_per_process": 1, "warmup_steps": args.warmup, "timed_steps": args.steps, "reps": args.reps,
        "log_every_n_steps": args.log_every, "arms": args.arms, "design": args.design,
        "arms_in_order": [_common.rotated(args.arms, r) for r in range(min(args.reps, len(args.arms)))],
    }  # fmt: skip
    _common.write_outputs(result, args.out, tables(result))
    return result


if __name__ == "__main__":
    main()
