"""The pipeline bubble of each AccelParallel schedule: measured by the EfficiencyMonitor against its analytic value.

Every stage of a ``--pipeline`` x (1 or 2 stages per rank) pipeline sleeps ``--forward-ms`` in forward and
``--backward-ms`` in backward (a Linear, then an autograd function that sleeps in its backward), so compute time is
known and CPU load barely matters. For each schedule, pipeline size and micro-batch count the table gives the
EfficiencyMonitor's ``pipeline_bubble_frac`` (mean over ranks of 1 - busy / wall inside the schedule's steps), its
``pipeline_bubble_frac_analytic`` (the schedule's action order replayed with the measured action times) and the
textbook ``(p - 1) / (v m + p - 1)`` (equal forward and backward, ``v`` stages per rank; rank 0 of GPipe/1F1B).

Run (from the repository root)::

    python benchmarks/bubble.py            # writes benchmarks/results/bubble.json (+ .md)
    python benchmarks/bubble.py --tiny     # seconds: checks that it runs
"""

from __future__ import annotations

import time
from typing import Any

import _common
import torch
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear, self.forward_s, self.backward_s = nn.Linear(8, 8), forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return _SleepGrad.apply(self.linear(x), self.backward_s)


def measure(rank: int, world_size: int, args: Any, schedule: str, microbatches: int) -> dict[str, float]:
    import lightning.pytorch as pl

    from lit_accel import AccelParallel, EfficiencyMonitor, PipelineLoss

    class Model(PipelineLoss, pl.LightningModule):
        def __init__(self, depth: int) -> None:
            super().__init__()
            stage = (args.forward_ms / 1e3, args.backward_ms / 1e3)
            self.stages = nn.Sequential(*[SleepStage(*stage) for _ in range(depth)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stages(x)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(output, target)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    monitor = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    strategy = AccelParallel(pipeline_parallel=world_size, schedule=schedule, microbatches=microbatches)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[monitor],
                         max_steps=1 + args.steps, log_every_n_steps=1, **_common.QUIET_TRAINER)  # fmt: skip
    batch = (torch.randn(microbatches, 8), torch.randn(microbatches, 8))
    trainer.fit(Model(world_size * per_rank), _common.RepeatBatch(batch, 1 + args.steps))
    summary = monitor.summary
    return {key: summary[key] for key in ("pipeline_bubble_frac", "pipeline_bubble_frac_analytic")}


def worker(rank: int, world_size: int, args: Any) -> list[dict[str, Any]]:
    rows = []
    for schedule in args.schedules.split(","):
        for microbatches in (int(m) for m in args.microbatches.split(",")):
            rows.append({"schedule": schedule, "microbatches": microbatches,
                         **measure(rank, world_size, args, schedule, microbatches)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("bubble", __doc__)
    p.add_argument("--pipelines", default="2,4", help="comma-separated pipeline sizes (processes)")
    p.add_argument("--microbatches", default="8,16", help="comma-separated micro-batch counts")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedule names")
    p.add_argument("--forward-ms", type=float, default=20.0, help="each stage's forward sleep")
    p.add_argument("--backward-ms", type=float, default=40.0, help="each stage's backward sleep")
    p.add_argument("--steps", type=_common.positive_int, default=3, help="measured optimizer steps per cell")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    if args.tiny:
        args.pipelines, args.microbatches, args.schedules, args.steps = "2", "4", "1f1b", 1
        args.forward_ms, args.backward_ms = 2.0, 4.0
    start = time.perf_counter()
    results, rows = [], []
    for pipeline in (int(x) for x in args.pipelines.split(",")):
        for cell in _common.launch(worker, pipeline, args)[0]:
            virtual = 1 if cell["schedule"] in ("gpipe", "1f1b") else 2
            textbook = (pipeline - 1) / (virtual * cell["microbatches"] + pipeline - 1)
            results.append({"pipeline": pipeline, **cell, "textbook": textbook})
            rows.append([cell["schedule"], pipeline, cell["microbatches"], f"{cell['pipeline_bubble_frac']:.3f}",
                         f"{cell['pipeline_bubble_frac_analytic']:.3f}", f"{textbook:.3f}"])  # fmt: skip
    result = {
        "benchmark": "bubble",
        "command": _common.command_line("bubble.py", argv),
        "machine": _common.machine_info(),
        "wall_s": round(time.perf_counter() - start, 1),
        "setup": {"forward_ms": args.forward_ms, "backward_ms": args.backward_ms, "steps": args.steps},
        "results": results,
    }
    headers = ["schedule", "p", "m", "measured bubble", "analytic (replay)", "textbook (p-1)/(vm+p-1)"]
    _common.write_outputs(result, args.out, _common.markdown_table(headers, rows))
    return result


if __name__ == "__main__":
    main()
