"""The pipeline bubble in the EfficiencyMonitor: measured on every rank, beside the schedule's analytic value.

Stages that sleep a known time in forward and in backward make the schedule's idle time predictable: the mean measured
bubble must be within 0.05 of the analytic one (the schedule's action order replayed with the same durations), the
analytic one of rank 0 equal to (p - 1) / (m + p - 1) for 1F1B, and zero-bubble below 1F1B at p = 4. The pure parts
(the replay, the orders) are checked with exact numbers.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import AccelParallel, EfficiencyMonitor, MemoryMonitor, PipelineLoss
from lit_accel.meters.pipeline_bubble import simulate, single_stage_order
from tests.helpers import run_distributed
from tests.helpers.models import small_trainer_kwargs

FORWARD_S, BACKWARD_S = 0.04, 0.08  # long beside the per-action overheads of gloo on a loaded CPU


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pipeline", "microbatches"), [(2, 8), (4, 8), (4, 16)])
def test_the_replay_gives_the_textbook_bubble_on_rank_zero(schedule, pipeline, microbatches):
    replay = simulate(single_stage_order(schedule, pipeline, microbatches), {"F": 1.0, "B": 2.0}, pipeline)
    busy, finish = replay[0]
    assert busy == 3.0 * microbatches
    assert 1 - busy / finish == pytest.approx((pipeline - 1) / (microbatches + pipeline - 1))
    assert all(replay[r][1] <= finish for r in replay)  # rank 0 ends last: its last backward closes the step


def test_1f1b_keeps_at_most_p_micro_batches_in_flight():
    order = single_stage_order("1f1b", 4, 8)
    for rank, actions in order.items():
        in_flight, peak = 0, 0
        for _, kind, _ in actions:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - rank  # GPipe would hold all 8


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(BACKWARD_S)
        return grad


class SleepBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(FORWARD_S)
        return _SleepGrad.apply(self.linear(x))  # after the weights: every stage's backward sleeps


class SleepModel(PipelineLoss, pl.LightningModule):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[SleepBlock() for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _measure(rank: int, world: int, schedule: str, microbatches: int) -> dict[str, float]:
    stages_per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    monitor = EfficiencyMonitor(warmup_steps=1, count_flops=False, print_summary=False)
    trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=world, schedule=schedule, microbatches=microbatches),
                         callbacks=[monitor], log_every_n_steps=1,
                         **small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1))  # fmt: skip
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    trainer.fit(SleepModel(world * stages_per_rank), DataLoader(data, batch_size=microbatches))
    return monitor.summary


def _bubble(schedule: str, pipeline: int, microbatches: int, tolerance: float = 0.05) -> dict[str, float]:
    summaries = run_distributed(_measure, pipeline, schedule, microbatches, init_process_group=False, timeout=300)
    summary = summaries[0]
    measured, analytic = summary["pipeline_bubble_frac"], summary["pipeline_bubble_frac_analytic"]
    assert abs(measured - analytic) <= tolerance, (schedule, pipeline, microbatches, measured, analytic)
    assert all(f"pipeline_bubble_frac_rank{r}" in summary for r in range(pipeline))
    assert summary["pipeline_bubble_frac_max"] >= measured
    return summary


def test_measured_bubble_matches_the_analytic_one():
    summary = _bubble("1f1b", 2, 8)
    # Rank 0 idles (p - 1) of its (m + p - 1) forward-backward slots.
    assert summary["pipeline_bubble_frac_rank0"] == pytest.approx(1 / 9, abs=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(("pipeline", "microbatches"), [(2, 16), (4, 8), (4, 16)])
def test_measured_bubble_matches_the_analytic_one_1f1b(pipeline, microbatches):
    summary = _bubble("1f1b", pipeline, microbatches)
    expected = (pipeline - 1) / (microbatches + pipeline - 1)
    assert summary["pipeline_bubble_frac_rank0"] == pytest.approx(expected, abs=0.05)


@pytest.mark.slow
def test_zero_bubble_idles_less_than_1f1b_at_four_stages():
    one_f_one_b = _bubble("1f1b", 4, 8)
    # The split backward doubles the timed actions, each with its gloo and Python overhead beside the sleeps: with 4
    # processes on 2 cores (an AVX2 VM, 2026-12-06) measured - analytic was 0.060-0.065 in 3 of 3 runs, so 0.08 here;
    # the comparison with 1f1b's bubble (analytic 3/11) is what this test is about.
    zero_bubble = _bubble("zero_bubble", 4, 8, tolerance=0.08)
    assert zero_bubble["pipeline_bubble_frac"] < one_f_one_b["pipeline_bubble_frac"]


def _monitored(rank: int, world: int) -> tuple[dict[str, float], dict[str, float]]:
    from tests.helpers.parallel import PipeModel, dataset

    efficiency = EfficiencyMonitor(warmup_steps=1, print_summary=False)  # no FLOP count under a pipeline: no hooks
    memory = MemoryMonitor(print_summary=False)
    kwargs = small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1, log_every_n_steps=1)
    trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=2), callbacks=[efficiency, memory], **kwargs)
    trainer.fit(PipeModel(), DataLoader(dataset(64), batch_size=8))
    return efficiency.summary, memory.report["per_rank"][rank], memory.summary


def test_monitors_under_pipeline_and_data_parallel():
    from tests.helpers.parallel import PipeModel

    results = run_distributed(_monitored, 4, init_process_group=False, timeout=300)
    efficiency = results[0][0]
    assert 0.0 < efficiency["pipeline_bubble_frac"] < 1.0 and "pipeline_bubble_frac_analytic" in efficiency
    assert efficiency["comm_gb_per_step"] > 0  # FSDP's collectives and the stages' sends
    assert "tflops_per_device" not in efficiency
    params = [row["params"]["total"] for _, row, _ in results]  # MemoryMonitor's per-rank rows: ranks 0, 1 hold stage 0
    # stage 0: embed 6x8+8 and two blocks of 2x(8x16)+16+8; stage 1: two blocks, norm 2x8, head 8x3+3 (fp32, in 2)
    assert params[0] + params[1] == 4 * (56 + 2 * 280)
    assert params[2] + params[3] == 4 * (2 * 280 + 16 + 27)
    # Per stage, the larger of its two FSDP shards: fully_shard gives rank 0 ceil(d0 / 2) rows of every parameter.
    model = PipeModel()
    stages = {0: [model.embed, *model.blocks[:2]], 1: [*model.blocks[2:], model.norm, model.head]}
    memory = results[0][2]
    for stage, modules in stages.items():
        nbytes = sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for m in modules for p in m.parameters())
        assert memory[f"stage{stage}/params_mb"] == nbytes / 1e6
    assert memory["params_mb"] == max(memory["stage0/params_mb"], memory["stage1/params_mb"])
