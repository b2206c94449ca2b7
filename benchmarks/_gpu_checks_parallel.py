"""Check 10 of ``gpu_check.py``: AccelParallel's pipeline parts on one GPU (what needs no second device).

One process holds a two-stage pipeline (``interleaved_1f1b`` with both stages on the one rank, torch's single-rank
case) of residual MLP blocks whose widths are multiples of 16, in bf16 autocast:

* a stage under ``torch.compile`` and FP8 (``Float8Conversion``; tensor cores on capability >= 8.9, emulated
  elsewhere; the CPU dry run stays eager) trains through ``PipelineRunner`` with finite losses, and its first
  gradients match the eager bf16 pipeline's within FP8's error (relative norm of the difference below 0.2);
* the bubble meter on CUDA events: busy time inside the actions is positive and at most the steps' wall, resolved
  only at ``pop()`` (the logging step), and with one rank the analytic bubble is 0 and the measured one small.

Not a library module: ``gpu_check.py`` imports it as ``_gpu_checks_parallel`` (``benchmarks/`` first on ``sys.path``)
and adds its ``CHECKS`` to its own with one line.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import _common
import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn

Row = dict[str, str]
# FP8's 3 mantissa bits give a few percent per matmul; over 4 blocks the first gradients stay within this of bf16's.
FP8_GRAD_TOLERANCE = 0.2


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def _one_rank_group(ctx: dict[str, Any]) -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_common.free_port()))
        dist.init_process_group("nccl" if ctx["cuda"] else "gloo", rank=0, world_size=1)


def _runner(ctx: dict[str, Any], blocks: nn.ModuleList) -> Any:
    from lit_accel.layout.schedules import SCHEDULES
    from lit_accel.layout.stages import StageModule
    from lit_accel.strategies.sharded._pipeline import PipelineRunner
    from lit_accel.strategies.sharded._stage import ParallelCommStats

    stages = [StageModule(0, [("blocks.0", blocks[0]), ("blocks.1", blocks[1])]),
              StageModule(1, [("blocks.2", blocks[2]), ("blocks.3", blocks[3])])]  # fmt: skip
    loss = lambda out, target: nn.functional.mse_loss(out.float(), target)  # noqa: E731
    return PipelineRunner("gpu_check", SCHEDULES["interleaved_1f1b"], stages, 2, dist.group.WORLD, ctx["device"], 4,
                          loss, ParallelCommStats())  # fmt: skip


class _Batch:
    """``(inputs, target)`` under the mixin's default split (a plain object would not do for ``split_batch``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def pipeline_batch(self, batch: Any) -> tuple[Any, Any]:
        return batch


def _train(ctx: dict[str, Any], blocks: nn.ModuleList, steps: int) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """``steps`` optimizer steps; the bubble meter is emptied after the first (metadata inference, compilation)."""
    runner = _runner(ctx, blocks)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randn(64, ctx["width"], generator=g).to(ctx["device"]) for _ in range(2))
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    device_type = "cuda" if ctx["cuda"] else "cpu"
    for step in range(steps):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = runner.train_step(batch, _Batch(blocks))  # type: ignore[arg-type]
        runner.restore_gradients()
        if step == 0:
            first = {n: p.grad.detach().float().clone() for n, p in blocks.named_parameters()}
            runner.meter.pop()
        optimizer.step()
        losses.append(float(loss))
    return losses, first, runner


def check_parallel(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    from lit_accel.layout.schedules import V_ON_GLOO_SINCE
    from lit_accel.plugins.float8 import Float8Conversion

    if not ctx["cuda"] and Version(torch.__version__).release < V_ON_GLOO_SINCE.release:
        # Both stages on this one rank send to each other; gloo before torch 2.14 cannot send to the same rank (the
        # reason AccelParallel refuses the V schedules there). NCCL can: the CUDA run is unaffected.
        reason = f"torch {torch.__version__} on gloo cannot send between two stages of one rank ({V_ON_GLOO_SINCE} can)"
        return [{"check": "pipeline stage under compile + FP8", "result": "n/a", "detail": reason}], {"skipped": reason}
    _one_rank_group(ctx)
    ctx = {**ctx, "width": 64 if ctx["dry_run"] else 1024}
    torch.manual_seed(0)
    eager = nn.ModuleList([_Block(ctx["width"]) for _ in range(4)]).to(ctx["device"])
    fast = copy.deepcopy(eager)
    conversion = Float8Conversion()
    fast = conversion.apply(fast, ctx["device"])
    compiled = ctx["cuda"]  # a CPU compile of the emulated FP8 graph takes minutes: the dry run stays eager
    for block in fast if compiled else ():
        block.forward = torch.compile(block.forward)  # per block, as AccelParallel's compile would
    eager_losses, eager_grads, _ = _train(ctx, eager, 4)
    fast_losses, fast_grads, runner = _train(ctx, fast, 4)
    diff = max(float((fast_grads[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in eager_grads.items())
    finite = all(torch.isfinite(torch.tensor(fast_losses)))
    emulated = conversion.emulation_for(ctx["device"])
    kind = ("emulated" if emulated else "FP8 tensor cores") + (", compiled" if compiled else ", eager")
    ok = finite and diff < FP8_GRAD_TOLERANCE
    rows = [{"check": "pipeline stage under compile + FP8", "result": "PASS" if ok else "FAIL",
             "detail": f"gradient relative difference {diff:.3f} vs eager bf16 ({kind});"
                       f" losses {fast_losses[0]:.4g} -> {fast_losses[-1]:.4g}"}]  # fmt: skip
    busy, wall, idle = runner.meter.pop()
    ok = 0 < busy <= wall and idle < 0.05 * wall and 1 - busy / wall < 0.25
    rows.append({"check": "bubble meter on " + ("CUDA events" if ctx["cuda"] else "the host clock"),
                 "result": "PASS" if ok else "FAIL",
                 "detail": f"busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms in 3 steps (one rank: analytic idle"
                           f" {idle * 1e3:.2f} ms)"})  # fmt: skip
    data = {"grad_rel_diff": diff, "losses": fast_losses, "eager_losses": eager_losses, "busy_s": busy, "wall_s": wall}
    return rows, data


CHECKS = {"parallel": check_parallel}
