"""Per-step overhead of lit_accel over plain Lightning and over a raw PyTorch DDP loop, measured in one run.

Two CPU processes joined by gloo (``launch`` in ``_common.py`` sets the environment ``torchrun`` would, so every
Trainer built inside them joins the existing group) run, in interleaved repetitions (``raw lightning lit_accel``, then
``lightning lit_accel raw``, ...), three arms that do the same math - same model, initial weights, data, micro-batch,
AdamW, bf16 autocast on CPU, DDP with ``gradient_as_bucket_view=True`` and 25 MiB buckets:

* ``raw``: ``DistributedDataParallel`` + ``torch.autocast("cpu", torch.bfloat16)`` + ``AdamW``, a plain loop;
* ``lightning``: ``Trainer(strategy=DDPStrategy(gradient_as_bucket_view=True),
  plugins=[MixedPrecision("bf16-mixed", "cpu")])``, no callbacks;
* ``lit_accel``: ``Trainer(strategy=AccelDDP(), plugins=[AccelPrecision("bf16-mixed")],
  callbacks=[LossScaleMonitor(), EfficiencyMonitor(print_summary=False)])`` (AccelDDP adds its HangWatchdog);
* ``full_stack``: ``lit_accel`` plus ``MemoryMonitor`` (SyncBN is on by default; the ViT has no BatchNorm);
* ``accel_fsdp``: ``AccelFSDP()`` + ``AccelPrecision("bf16-mixed")``, against ``model_parallel``: Lightning's
  ``ModelParallelStrategy`` + ``MixedPrecision`` with the ``configure_model`` that shards the same blocks with the
  same ``MixedPrecisionPolicy`` (``shard_like_accel_fsdp``);
* ``lit_accel_compiled`` (``--arms``, or ``benchmarks/compile.py``): ``lit_accel`` with ``AccelDDP(compile=True)``.

(``AccelDDP`` lets gradients alias DDP's buckets by default; plain ``DDPStrategy`` does not, so the Lightning arm is
given the same setting: the ratio measures lit_accel's own per-step code, not a DDP default. ``--arms`` can add
``lightning_defaults``, ``DDPStrategy()`` as it comes.)

**What is timed.** Each repetition of an arm is one fresh fit (or loop) of ``--warmup + --steps + 1`` optimizer steps;
host-clock stamps are taken at the start of every step (a tiny callback's ``on_train_batch_start`` in the Lightning
arms, the top of the loop body in the raw arm). A step's time is the period between two stamps, on the slowest rank:
everything done per step - data fetch, hooks, forward, backward, all-reduce, optimizer, and on logging steps
(``log_every_n_steps=--log-every``, 10 by default: five times Lightning's default rate, so the EfficiencyMonitor's
per-window gather runs more often than in a default run) the logging work. Per repetition and arm three numbers are
kept over the ``--steps`` steps after the warm-up: the **median step** (robust to a step stalled by another process on
a shared machine: the headline), the **mean step** (every step counts, logging steps in proportion) and the **CPU
time per step** (``time.process_time`` of the process, all its threads: work done, which waiting for a core or for
the peer does not inflate). Setup and teardown of a fit are not timed. Ratios are per-repetition (paired) ratios;
the tables give their median and spread over ``--reps`` repetitions. ``overhead ratio`` is the median of the paired
lit_accel / Lightning median-step ratios.

Models: ``vit`` (default) is a CIFAR-sized ViT (timm ``vit_tiny_patch16_224`` at 32x32 px, patch 4, width 192,
depth 6, 2.7 M parameters, 16 images per process): a realistic small training step on a CPU core. ``mlp`` is a tiny
MLP whose step is a few milliseconds, so that the per-step framework cost is exposed in absolute terms.

Run (from the repository root)::

    python benchmarks/overhead.py                          # writes benchmarks/results/overhead.json (+ .md)
    python benchmarks/overhead.py --model mlp --steps 200 --reps 15 --out benchmarks/results/overhead_mlp.json
    python benchmarks/overhead.py --tiny                   # a few seconds: checks that it runs
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Any

import _common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ARMS = ("raw", "lightning", "lit_accel", "lightning_defaults", "full_stack", "lit_accel_compiled", "accel_fsdp",
        "model_parallel")  # fmt: skip
DEFAULT_ARMS = ("raw", "lightning", "lit_accel", "full_stack", "accel_fsdp", "model_parallel")
TARGET = 1.01  # issue #9: lit_accel / plain Lightning <= 1.01
FULL_STACK_TARGET = 1.02  # issue #18: everything on / plain Lightning <= 1.02


def build_net(kind: str) -> nn.Module:
    """The benchmark model, with fixed initial weights."""
    torch.manual_seed(0)
    if kind == "vit":
        import timm

        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=4, depth=6
        )
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.GELU(), nn.Linear(256, 10))
    if kind == "tiny":  # smoke tests only
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.GELU(), nn.Linear(16, 10))
    raise ValueError(f"unknown model {kind!r}")


def make_loader(rank: int, world_size: int, batch: int, batches: int) -> DataLoader:
    """``batches`` micro-batches of random 32x32 RGB images per rank, in a fixed order (no shuffling)."""
    g = torch.Generator().manual_seed(1)
    n = world_size * batch * batches
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)


def _optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def _autocast(precision: str) -> Any:
    if precision == "32-true":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def run_raw(args: Any, loader: DataLoader) -> tuple[list[float], list[float]]:
    """The raw PyTorch DDP loop; returns the step-start stamps (wall clock, process CPU time)."""
    from torch.nn.parallel import DistributedDataParallel

    net = build_net(args.model)
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    opt = _optimizer(model.parameters(), args.lr)
    stamps: list[float] = []
    cpu: list[float] = []
    for x, y in loader:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        # cache_enabled=False as in Lightning's MixedPrecision and AccelPrecision: the same casts in every arm.
        with _autocast(args.precision):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return stamps, cpu


def shard_like_accel_fsdp(module: Any, param_dtype: torch.dtype | None) -> None:
    """The ``configure_model`` ModelParallelStrategy needs: ``fully_shard`` the blocks AccelFSDP picks, then the net.

    The net, not the LightningModule, is the root: its ``forward`` is what ``training_step`` calls, and FSDP2 gathers
    a root's own parameters in its forward hooks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lit_accel.layout.blocks import find_blocks

    mesh = module.device_mesh["data_parallel"]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in reversed(find_blocks("benchmark", module.net, "auto")):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module.net, mesh=mesh, mp_policy=policy)


def run_trainer(arm: str, args: Any, loader: DataLoader, world_size: int) -> tuple[list[float], list[float]]:
    """One Lightning fit of the arm; returns the step-start stamps (wall clock, process CPU time)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lit_accel import AccelDDP, AccelFSDP, EfficiencyMonitor, LossScaleMonitor, MemoryMonitor

    class StepClock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.stamps.append(time.perf_counter())
            self.cpu.append(time.process_time())

    clock = StepClock()
    callbacks: list[Callback] = [clock]
    module = _common.classifier(build_net(args.model), lambda params: _optimizer(params, args.lr))
    bf16 = args.precision == "bf16-mixed"
    lightning_plugins: list[Any] = [MixedPrecision("bf16-mixed", device="cpu")] if bf16 else []
    plugins: list[Any] = _common.precision_plugins(args.precision)  # none for 32-true: Lightning's own
    if arm in ("lit_accel", "lit_accel_compiled", "full_stack"):
        strategy: Any = AccelDDP(compile=arm == "lit_accel_compiled")
        callbacks += [LossScaleMonitor(), EfficiencyMonitor(print_summary=False)]
        if arm == "full_stack":  # SyncBN is on by default (a ViT has no BatchNorm to convert)
            callbacks.append(MemoryMonitor(print_summary=False))
    elif arm == "accel_fsdp":
        strategy = AccelFSDP()
    elif arm == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        dtype = torch.bfloat16 if bf16 else None
        module.configure_model = lambda: shard_like_accel_fsdp(module, dtype)  # type: ignore[method-assign]
        plugins = lightning_plugins
    else:
        strategy = DDPStrategy(gradient_as_bucket_view=True) if arm == "lightning" else DDPStrategy()
        plugins = lightning_plugins
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        plugins=plugins,
        callbacks=callbacks,
        max_steps=args.warmup + args.steps + 1,
        log_every_n_steps=args.log_every,
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=loader)
    return clock.stamps, clock.cpu


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    """Runs in every process: all arms, interleaved, ``args.reps`` times."""
    loader = make_loader(rank, world_size, args.batch, args.warmup + args.steps + 1)
    steps: dict[str, list[float]] = {arm: [] for arm in args.arms}  # reps x steps periods, flattened
    cpu: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for rep in range(args.reps):
        for arm in _common.rotated(args.arms, rep):
            dist.barrier()  # every arm starts with both ranks ready
            stamps, cpu_stamps = run_raw(args, loader) if arm == "raw" else run_trainer(arm, args, loader, world_size)
            timed = stamps[args.warmup : args.warmup + args.steps + 1]
            steps[arm] += [b - a for a, b in itertools.pairwise(timed)]
            cpu[arm].append(_common.mean_period(cpu_stamps, args.warmup, args.steps))
    # Step by step, the slowest rank's period (DDP keeps the ranks in lockstep, so they are nearly equal).
    return {
        "steps": {arm: _common.slowest_rank(values) for arm, values in steps.items()},
        "cpu": {arm: _common.slowest_rank(values) for arm, values in cpu.items()},
        "params": sum(p.numel() for p in build_net(args.model).parameters()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("overhead", __doc__)
    p.add_argument("--model", choices=("vit", "mlp", "tiny"), default="vit", help="benchmark model (see above)")
    p.add_argument("--batch", type=_common.positive_int, default=None, help="images per process (vit 16, mlp 64)")
    p.add_argument("--steps", type=_common.positive_int, default=16, help="timed optimizer steps per repetition")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each fit (>= 4: the"
                   " EfficiencyMonitor counts FLOPs in step 0 and opens its window after 3)")  # fmt: skip
    p.add_argument("--reps", type=_common.positive_int, default=10, help="interleaved repetitions of every arm")
    p.add_argument("--log-every", type=_common.positive_int, default=10, help="Trainer(log_every_n_steps=)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--world-size", type=_common.positive_int, default=2, help="processes")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument(
        "--precision",
        choices=("bf16-mixed", "32-true"),
        default="bf16-mixed",
        help="every arm's precision (32-true on a CPU without AVX-512 BF16, where bf16 is emulated)",
    )
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes: tiny model, 3 steps, 2 repetitions")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: expected distinct names from {', '.join(ARMS)}")
    if args.tiny:
        args.model, args.steps, args.warmup, args.reps, args.log_every = "tiny", 3, 4, 2, 2
    if args.batch is None:
        args.batch = {"vit": 16, "mlp": 64, "tiny": 4}[args.model]

    machine = _common.machine_info()
    start = time.perf_counter()
    ranks = _common.launch(worker, args.world_size, args)
    wall = time.perf_counter() - start
    n = args.steps
    per_rep: dict[str, dict[str, list[float]]] = {}
    for arm in args.arms:
        flat, cpu = ranks[0]["steps"][arm], ranks[0]["cpu"][arm]
        reps = [flat[i * n : (i + 1) * n] for i in range(args.reps)]
        per_rep[arm] = {
            "median": [statistics.median(r) for r in reps],  # robust to a step stalled by another process
            "mean": [statistics.fmean(r) for r in reps],  # includes every step: logging steps in proportion
            "cpu": cpu,
        }
    arms: dict[str, Any] = {
        arm: {
            "median_step_ms": _common.summarize([1e3 * v for v in r["median"]], 3),
            "mean_step_ms": _common.summarize([1e3 * v for v in r["mean"]], 3),
            "cpu_ms_per_step": _common.summarize([1e3 * v for v in r["cpu"]], 3),
        }
        for arm, r in per_rep.items()
    }
    ratios: dict[str, Any] = {}
    pairs = [("lit_accel", "lightning"), ("lightning", "raw"), ("lit_accel", "raw")]
    pairs += [("lightning", "lightning_defaults"), ("lit_accel", "lightning_defaults"), ("full_stack", "lightning")]
    pairs += [("lit_accel_compiled", "lit_accel"), ("accel_fsdp", "model_parallel")]
    for num, den in pairs:
        if num in per_rep and den in per_rep:
            a, b = per_rep[num], per_rep[den]
            ratios[f"{num}/{den}"] = {
                "median_step": _common.summarize(_common.paired_ratios(a["median"], b["median"]), 4),
                "mean_step": _common.summarize(_common.paired_ratios(a["mean"], b["mean"]), 4),
                "cpu": _common.summarize(_common.paired_ratios(a["cpu"], b["cpu"]), 4),
                "median_step_difference_ms": _common.summarize(
                    [1e3 * (x - y) for x, y in zip(a["median"], b["median"])], 3
                ),
                "cpu_difference_ms": _common.summarize([1e3 * (x - y) for x, y in zip(a["cpu"], b["cpu"])], 3),
            }
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "command": _common.command_line("overhead.py", argv),
        "machine": machine,
        "load_average_after": _common.load_average(),
        "wall_s": round(wall, 1),
        "setup": {
            "model": args.model,
            "parameters": ranks[0]["params"],
            "micro_batch_per_process": args.batch,
            "world_size": args.world_size,
            "backend": "gloo",
            "threads_per_process": 1,
            "precision": args.precision
            + (" (torch.autocast cpu bfloat16, cache_enabled=False)" if args.precision == "bf16-mixed" else ""),
            "optimizer": f"AdamW(lr={args.lr}), foreach",
            "ddp": "gradient_as_bucket_view=True, bucket_cap_mb=25 (lightning_defaults: False)",
            "timed_steps_per_rep": args.steps,
            "warmup_steps_per_rep": args.warmup,
            "reps": args.reps,
            "log_every_n_steps": args.log_every,
            "arms_in_order": [_common.rotated(args.arms, r) for r in range(min(args.reps, len(args.arms)))],
        },
        "arms": arms,
        "ratios": ratios,
        # The raw values, repetition by repetition (for pooling runs or other statistics).
        "per_rep_ms": {
            arm: {kind: [round(1e3 * v, 3) for v in values] for kind, values in r.items()} for arm, r in per_rep.items()
        },
    }
    headline = ratios.get("lit_accel/lightning")
    if headline is not None:
        result["overhead_ratio"] = headline["median_step"]["median"]
        result["overhead_ratio_cpu_time"] = headline["cpu"]["median"]
        result["target"] = TARGET
        result["target_met"] = headline["median_step"]["median"] <= TARGET
    full = ratios.get("full_stack/lightning")
    if full is not None:
        result["full_stack_ratio"] = full["median_step"]["median"]
        result["full_stack_target"] = FULL_STACK_TARGET
        result["full_stack_target_met"] = full["median_step"]["median"] <= FULL_STACK_TARGET

    def span(stats: dict[str, float], fmt: str) -> str:
        return f"{stats['q1']:{fmt}}-{stats['q3']:{fmt}}"

    rows = [
        [arm, f"{a['median_step_ms']['median']:.2f}", span(a["median_step_ms"], ".2f"),
         f"{a['median_step_ms']['min']:.2f}-{a['median_step_ms']['max']:.2f}", f"{a['mean_step_ms']['median']:.2f}",
         f"{a['cpu_ms_per_step']['median']:.2f}", span(a["cpu_ms_per_step"], ".2f")]
        for arm, a in arms.items()
    ]  # fmt: skip
    table = _common.markdown_table(
        ["arm", "median step (ms)", "IQR", "min-max", "mean step (ms)", "CPU time / step (ms)", "IQR"], rows
    )
    ratio_rows = [
        [name, f"{r['median_step']['median']:.4f}", span(r["median_step"], ".4f"),
         f"{r['median_step_difference_ms']['median']:+.2f}", f"{r['mean_step']['median']:.4f}",
         span(r["mean_step"], ".4f"), f"{r['cpu']['median']:.4f}", span(r["cpu"], ".4f"),
         f"{r['cpu_difference_ms']['median']:+.2f}"]
        for name, r in ratios.items()
    ]  # fmt: skip
    table += "\n" + _common.markdown_table(
        ["ratio", "median step", "IQR", "difference (ms)", "mean step", "IQR", "CPU time", "IQR",
         "CPU difference (ms)"],
        ratio_rows,
    )  # fmt: skip
    if headline is not None:
        table += "\n" + _common.markdown_table(
            ["", ""],
            [["overhead ratio", f"{result['overhead_ratio']:.4f}"],
             ["overhead ratio, CPU time", f"{result['overhead_ratio_cpu_time']:.4f}"]],
        )  # fmt: skip
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
