"""AccelParallel against Lightning's ModelParallelStrategy on the same 2-D layout (data x tensor), in one run.

CPU processes joined by gloo (``_common.launch``) train a residual MLP language-model stand-in (``Net``: embedding
Linear, ``--depth`` blocks of Linear -> GELU -> Linear of width ``--width`` and 4x hidden, a head; AdamW, fp32) in
interleaved repetitions of two arms on 4 processes (data 2 x tensor 2):

* ``accel_parallel``: ``Trainer(strategy=AccelParallel(tensor_parallel=2))`` (the ``"auto"`` plan: each block's first
  Linear column-wise, its second row-wise; FSDP2 per block over the data dimension);
* ``model_parallel``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with the
  ``configure_model`` that strategy requires, applying the same plan and the same ``fully_shard`` calls.

Per arm: the median step time of the slowest rank (between two ``on_train_batch_start`` stamps, after ``--warmup``),
the bytes of parameters + gradients + optimizer state this rank holds (local shards), and FSDP's all-gathers and
reduce-scatters per optimizer step, counted by lit_accel's counting hooks installed on both arms' FSDP modules (the
tensor-parallel all-reduces inside the blocks are the same in both arms and not counted). Ratios are paired per
repetition (``_common.py``).

Run (from the repository root)::

    python benchmarks/parallel.py            # writes benchmarks/results/parallel.json (+ .md)
    python benchmarks/parallel.py --tiny     # a few seconds: checks that it runs
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import _common
import torch
import torch.distributed as dist
from fsdp import _local_bytes
from torch import nn

ARMS = ("accel_parallel", "model_parallel")
WORLD, TENSOR = 4, 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def build_module(width: int, depth: int) -> Any:
    import lightning.pytorch as pl

    from lit_accel import PipelineLoss

    class Net(PipelineLoss, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(64, width)
            self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(output, target)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Net()


def parallelize_like_accel_parallel(module: Any, stats: Any) -> None:
    """ModelParallelStrategy's ``configure_model``: the same TP plan and ``fully_shard`` calls AccelParallel makes."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lit_accel.strategies.sharded._fsdp_comm import install_counting_comms

    mesh = module.device_mesh
    plan = {}
    for i in range(len(module.blocks)):
        plan.update({f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
    parallelize_module(module, mesh["tensor_parallel"], plan)
    for unit in (module.embed, *module.blocks, module.head):
        fully_shard(unit, mesh=mesh["data_parallel"], reshard_after_forward=True)  # AccelParallel's ZeRO-3 default
    install_counting_comms(module, stats)


def run_arm(arm: str, args: Any, loader: Any) -> tuple[list[float], int, float]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_accel import AccelParallel
    from lit_accel.strategies.sharded._fsdp_comm import FSDPCommStats

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.local_bytes = 0

        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            self.stamps.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:
                self.local_bytes = _local_bytes(optimizer)

    module = build_module(args.width, args.depth)
    if arm == "model_parallel":
        strategy: Any = ModelParallelStrategy(data_parallel_size=WORLD // TENSOR, tensor_parallel_size=TENSOR)
        stats = FSDPCommStats()
        module.configure_model = lambda: parallelize_like_accel_parallel(module, stats)  # type: ignore[method-assign]
    else:
        strategy = AccelParallel(tensor_parallel=TENSOR)
    probe = Probe()
    steps = args.warmup + args.steps + 1
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, callbacks=[probe], max_steps=steps,
                         use_distributed_sampler=False, **_common.QUIET_TRAINER)  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    counted = strategy.comm_stats if arm == "accel_parallel" else stats
    collectives = (counted.all_gathers + counted.reduce_scatters) / steps
    return probe.stamps, probe.local_bytes, collectives


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1 + rank // TENSOR)  # the ranks of one tensor group load the same batch
    batch = (torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
    loader = _common.RepeatBatch(batch, args.warmup + args.steps + 1)
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    memory: dict[str, int] = {}
    collectives: dict[str, float] = {}
    for rep in range(args.reps):
        for arm in _common.rotated(ARMS, rep):
            dist.barrier()
            stamps, local_bytes, per_step = run_arm(arm, args, loader)
            timed = stamps[args.warmup : args.warmup + args.steps + 1]
            medians[arm].append(statistics.median(b - a for a, b in itertools.pairwise(timed)))
            memory[arm], collectives[arm] = local_bytes, per_step
    return {
        "median_step": {arm: _common.slowest_rank(values) for arm, values in medians.items()},
        "memory": memory,
        "collectives": collectives,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("parallel", __doc__)
    p.add_argument("--width", type=_common.positive_int, default=256, help="model width")
    p.add_argument("--depth", type=_common.positive_int, default=4, help="residual MLP blocks")
    p.add_argument("--batch", type=_common.positive_int, default=64, help="samples per data-parallel rank")
    p.add_argument("--steps", type=_common.positive_int, default=10, help="timed optimizer steps per repetition")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    p.add_argument("--reps", type=_common.positive_int, default=6, help="interleaved repetitions of every arm")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.batch, args.steps, args.warmup, args.reps = 16, 2, 8, 2, 1, 1
    start = time.perf_counter()
    rank0 = _common.launch(worker, WORLD, args)[0]
    steps = rank0["median_step"]
    ratio = _common.summarize(_common.paired_ratios(steps["accel_parallel"], steps["model_parallel"]), 4)
    results = {
        "median_step_ms": {arm: _common.summarize([1e3 * v for v in steps[arm]], 3) for arm in ARMS},
        "per_rank_state_mb": {arm: round(rank0["memory"][arm] / 1e6, 4) for arm in ARMS},
        "fsdp_collectives_per_step": rank0["collectives"],
        "accel_parallel/model_parallel": ratio,
    }
    rows = [[arm, f"{results['median_step_ms'][arm]['median']:.1f}", f"{results['per_rank_state_mb'][arm]:.3f}",
             f"{rank0['collectives'][arm]:.1f}"] for arm in ARMS]  # fmt: skip
    rows.append(["accel_parallel / model_parallel", f"{ratio['median']:.4f}", "", ""])
    result = {
        "benchmark": "parallel",
        "command": _common.command_line("parallel.py", argv),
        "machine": _common.machine_info(),
        "wall_s": round(time.perf_counter() - start, 1),
        "setup": dict(
            layout="data 2 x tensor 2",
            width=args.width,
            depth=args.depth,
            batch=args.batch,
            steps=args.steps,
            reps=args.reps,
            precision="32-true",
            optimizer="AdamW",
        ),
        "results": results,
    }
    headers = ["arm", "median step (ms)", "per-rank state (MB)", "FSDP collectives / step"]
    _common.write_outputs(result, args.out, _common.markdown_table(headers, rows))
    return result


if __name__ == "__main__":
    main()
