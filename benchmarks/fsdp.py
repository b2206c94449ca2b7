"""Step time and per-rank memory of AccelFSDP against Lightning's ModelParallelStrategy and AccelDDP, in one run.

CPU processes joined by gloo (``_common.launch``) train the CIFAR-sized ViT of ``overhead.py`` (timm
``vit_tiny_patch16_224`` at 32x32 px, patch 4, width 192, depth 6, 2.7 M parameters, 16 images per process, AdamW,
fp32) in interleaved repetitions of four arms:

* ``accel_fsdp``: ``Trainer(strategy=AccelFSDP())``, which shards each ViT ``Block`` and the root itself;
* ``model_parallel``: Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with a
  ``configure_model`` that applies ``fully_shard`` the same way (the user code that strategy requires);
* ``accel_ddp``: ``Trainer(strategy=AccelDDP())``, for the memory and time of not sharding;
* ``accel_fsdp_auto``: ``AccelFSDP(global_batch_size=B x N, micro_batch_size="auto")`` where everything fits, so the
  same single micro-batch per step once the search (measured runs on the first loaded batch, before the first step)
  chose it: the steady-state cost of "auto" after its one-time search, which ``--warmup`` leaves out.

A step is the period between two ``on_train_batch_start`` stamps on the slowest rank; per repetition the median over
``--steps`` steps after ``--warmup`` is kept, and the ratios are paired per repetition (see ``_common.py``). Memory is
the bytes of parameters + gradients + optimizer state this rank holds locally, read from the shards before the first
optimizer step's update (``DTensor.to_local()``). The issue's target: ``accel_fsdp / model_parallel <= 1.05``.

Run (from the repository root)::

    python benchmarks/fsdp.py                      # 2 and 4 processes; writes benchmarks/results/fsdp.json (+ .md)
    python benchmarks/fsdp.py --tiny               # a few seconds: checks that it runs
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import _common
import torch
import torch.distributed as dist
from overhead import build_net, make_loader, shard_like_accel_fsdp

ARMS = ("accel_fsdp", "model_parallel", "accel_ddp", "accel_fsdp_auto")
TARGET = 1.05  # issue #15: AccelFSDP step time <= 1.05 x ModelParallelStrategy's


def _local_bytes(optimizer: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = sum(local(p).numel() * p.element_size() for p in params)
    total += sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def run_arm(arm: str, args: Any, loader: Any, world_size: int) -> tuple[list[float], int]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_accel import AccelDDP, AccelFSDP

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.local_bytes = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.stamps.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:  # optimizer state exists from the first step on
                self.local_bytes = _local_bytes(optimizer)

    net = build_net(args.model)
    module = _common.classifier(net, lambda params: torch.optim.AdamW(params, lr=1e-4))
    if arm == "model_parallel":
        strategy: Any = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)

        module.configure_model = lambda: shard_like_accel_fsdp(module, None)  # type: ignore[method-assign]
    elif arm == "accel_fsdp_auto":
        strategy = AccelFSDP(global_batch_size=args.batch * world_size, micro_batch_size="auto")
    else:
        strategy = AccelFSDP() if arm == "accel_fsdp" else AccelDDP()
    probe = Probe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        callbacks=[probe],
        max_steps=args.warmup + args.steps + 1,
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=loader)
    return probe.stamps, probe.local_bytes


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    loader = make_loader(rank, world_size, args.batch, args.warmup + args.steps + 1)
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    memory: dict[str, int] = {}
    for rep in range(args.reps):
        for arm in _common.rotated(ARMS, rep):
            dist.barrier()
            stamps, local_bytes = run_arm(arm, args, loader, world_size)
            timed = stamps[args.warmup : args.warmup + args.steps + 1]
            medians[arm].append(statistics.median(b - a for a, b in itertools.pairwise(timed)))
            memory[arm] = local_bytes
    return {
        "median_step": {arm: _common.slowest_rank(values) for arm, values in medians.items()},
        "memory": memory,
        "params": sum(p.numel() for p in build_net(args.model).parameters()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("fsdp", __doc__)
    p.add_argument("--model", choices=("vit", "tiny"), default="vit", help="benchmark model (overhead.py's)")
    p.add_argument("--batch", type=_common.positive_int, default=16, help="images per process")
    p.add_argument("--steps", type=_common.positive_int, default=10, help="timed optimizer steps per repetition")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    p.add_argument("--reps", type=_common.positive_int, default=6, help="interleaved repetitions of every arm")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated process counts")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.batch, args.steps, args.warmup, args.reps, args.world_sizes = "tiny", 4, 2, 2, 1, "2"
    machine = _common.machine_info()
    start = time.perf_counter()
    results: dict[str, Any] = {}
    rows = []
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        rank0 = _common.launch(worker, world_size, args)[0]
        steps = rank0["median_step"]
        ratio = _common.summarize(_common.paired_ratios(steps["accel_fsdp"], steps["model_parallel"]), 4)
        results[str(world_size)] = {
            "median_step_ms": {arm: _common.summarize([1e3 * v for v in steps[arm]], 3) for arm in ARMS},
            "per_rank_state_mb": {arm: round(rank0["memory"][arm] / 1e6, 3) for arm in ARMS},
            "accel_fsdp/model_parallel": ratio,
            "accel_fsdp/accel_ddp": _common.summarize(
                _common.paired_ratios(steps["accel_fsdp"], steps["accel_ddp"]), 4
            ),
            "accel_fsdp_auto/accel_fsdp": _common.summarize(
                _common.paired_ratios(steps["accel_fsdp_auto"], steps["accel_fsdp"]), 4
            ),
            "target_met": ratio["median"] <= TARGET,
        }
        r = results[str(world_size)]
        for arm in ARMS:
            rows.append([world_size, arm, f"{r['median_step_ms'][arm]['median']:.1f}",
                         f"{r['per_rank_state_mb'][arm]:.2f}"])  # fmt: skip
        rows.append([world_size, "accel_fsdp / model_parallel", f"{ratio['median']:.4f}", ""])
        auto = r["accel_fsdp_auto/accel_fsdp"]["median"]
        rows.append([world_size, "accel_fsdp_auto / accel_fsdp", f"{auto:.4f}", ""])
    result = {
        "benchmark": "fsdp",
        "command": _common.command_line("fsdp.py", argv),
        "machine": machine,
        "wall_s": round(time.perf_counter() - start, 1),
        "setup": {
            "model": args.model,
            "batch_per_process": args.batch,
            "steps": args.steps,
            "reps": args.reps,
            "warmup": args.warmup,
            "precision": "32-true",
            "optimizer": "AdamW",
        },
        "target": TARGET,
        "results": results,
    }
    table = _common.markdown_table(["processes", "arm", "median step (ms)", "per-rank state (MB)"], rows)
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
