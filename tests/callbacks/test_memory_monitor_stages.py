"""MemoryMonitor per pipeline stage: under AccelParallel each stage's figures are the bytes of that stage's modules.

An uneven split (stage 1 is the head alone) on 2 real gloo processes through ``Trainer.fit``: every stage's
``params_mb`` and ``grads_mb`` equal the bytes of its modules counted here from a fresh model, stage 0 reports more,
and the largest stage is the existing maximum over ranks. The pp2 x dp2 run is in ``test_accel_parallel_bubble.py``.
The labels (``StagePlacement``) of the interleaved and V schedules and the per-stage arithmetic are checked exactly, and
Lightning's own strategy with the ``PipelineStages`` protocol added gets the per-stage figures too.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader

from lit_accel import AccelParallel, MemoryMeter, MemoryMonitor, ParallelPlan, PipelineStages, StagePlacement
from lit_accel.meters._memory_metrics import DtypeBytes, RankMemory, per_stage, stage_metrics
from lit_accel.meters.tables import stage_table
from tests.helpers import CaptureLogger, run_distributed, small_trainer_kwargs
from tests.helpers.parallel import PipeModel, dataset


def module_bytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _fit(rank: int, world: int) -> dict[str, Any]:
    logger = CaptureLogger()
    monitor = MemoryMonitor(print_summary=False)
    strategy = AccelParallel(pipeline_parallel=2, stage_split=["head"])  # stage 1: the head alone
    kwargs = small_trainer_kwargs(devices=world, max_steps=2, max_epochs=-1, log_every_n_steps=1, logger=logger)
    trainer = pl.Trainer(strategy=strategy, callbacks=[monitor], **kwargs)
    trainer.fit(PipeModel(), DataLoader(dataset(32), batch_size=8))
    assert isinstance(strategy, PipelineStages)
    return {"summary": monitor.summary, "report": monitor.report, "logged": logger.rows}


def test_each_stage_reports_the_bytes_of_its_own_modules():
    results = run_distributed(_fit, 2, init_process_group=False, timeout=180)
    model = PipeModel()
    expected = {0: module_bytes(model.embed, model.blocks, model.norm), 1: module_bytes(model.head)}
    summary, report = results[0]["summary"], results[0]["report"]
    for stage, nbytes in expected.items():
        assert summary[f"stage{stage}/params_mb"] == nbytes / 1e6
        assert summary[f"stage{stage}/grads_mb"] == nbytes / 1e6  # fp32 gradients of the same parameters
        assert summary[f"stage{stage}/optimizer_mb"] == nbytes / 1e6  # SGD's momentum buffers
    assert summary["stage0/params_mb"] > summary["stage1/params_mb"]
    assert summary["params_mb"] == max(summary[f"stage{k}/params_mb"] for k in expected)
    assert summary["params_spread"] == expected[0] / expected[1]
    assert [(e["stage"], e["ranks"], e["params_mb"]) for e in report["per_stage"]] == [
        (0, [0], expected[0] / 1e6),
        (1, [1], expected[1] / 1e6),
    ]
    assert [r["stage"] for r in report["per_rank"]] == [0, 1]
    assert report["config"]["pipeline_stages"] == [[0], [1]]
    logged = [metrics for _, metrics in results[0]["logged"] if "mem/params_mb" in metrics]
    assert len(logged) == 2  # both steps are logging steps (the end of fit logs nothing new)
    for metrics in logged:
        assert metrics["mem/stage0/params_mb"] == expected[0] / 1e6
        assert metrics["mem/stage1/params_mb"] == expected[1] / 1e6
    assert results[1]["logged"] == []  # rank 0 logs


# Issue #46: 8 micro-batches of 256 samples through 1F1B on 2 stages, whose activations dominate (each block saves a
# 256 x 32768 fp32 tanh output, 34 MB; its parameters are 4 MB). 1F1B holds at most 2 micro-batches per stage; a probe
# that kept what it saw would hold all 8 for the whole step, as GPipe does.
WIDE = {"depth": 4, "width": 16, "hidden": 32768}
MICRO, PER_MICRO = 8, 256


def _wide_fit(rank: int, world: int, monitored: bool) -> dict[str, Any]:
    import resource

    pl.seed_everything(0, verbose=False)
    monitor = MemoryMonitor(print_summary=False)
    strategy = AccelParallel(pipeline_parallel=2, schedule="1f1b", microbatches=MICRO)
    kwargs = small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1, log_every_n_steps=1)
    trainer = pl.Trainer(strategy=strategy, callbacks=[monitor] if monitored else [], **kwargs)
    trainer.fit(PipeModel(**WIDE), DataLoader(dataset(3 * MICRO * PER_MICRO), batch_size=MICRO * PER_MICRO))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rss": rss, "summary": monitor.summary if monitored else {}}


def test_a_pipelines_activations_are_one_micro_batchs_and_the_monitor_holds_none_of_them():
    plain = run_distributed(_wide_fit, 2, False, init_process_group=False, timeout=300)
    watched = run_distributed(_wide_fit, 2, True, init_process_group=False, timeout=300)
    for rank, (a, b) in enumerate(zip(plain, watched)):
        assert b["rss"] <= 1.10 * a["rss"], f"rank {rank}: {b['rss'] / 1e6:.0f} MB watched, {a['rss'] / 1e6:.0f} MB not"
    # one micro-batch's: the two stages' figures add up to one process's forward of 256 samples
    single = MemoryMonitor(print_summary=False)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=[single], **small_trainer_kwargs(max_steps=1, log_every_n_steps=1))
    trainer.fit(PipeModel(**WIDE), DataLoader(dataset(PER_MICRO), batch_size=PER_MICRO))
    summary = watched[0]["summary"]
    stages = summary["stage0/activations_mb"] + summary["stage1/activations_mb"]
    assert stages == pytest.approx(single.summary["activations_mb"], rel=0.02), (stages, single.summary)
    assert summary["stage0/activations_mb"] >= 2 * PER_MICRO * WIDE["hidden"] * 4 / 1e6  # its two tanh outputs


@pytest.mark.parametrize(
    ("schedule", "pipeline", "held"),
    [
        ("1f1b", 4, ((0,), (1,), (2,), (3,))),
        ("interleaved_1f1b", 2, ((0, 2), (1, 3))),
        ("zbv", 2, ((0, 3), (1, 2))),
    ],
)
def test_placement_labels_each_rank_by_its_pipeline_coordinate(schedule, pipeline, held):
    plan = ParallelPlan.build("test", 2 * pipeline, pipeline_parallel=pipeline, schedule=schedule)  # data 2: ranks 2k,
    for rank in range(2 * pipeline):  # 2k + 1 share stages
        placement = plan.placement(rank)
        assert placement == StagePlacement(rank // 2, held)
        assert placement.stages[placement.pipeline_rank][0] == placement.pipeline_rank  # its first stage


def test_per_stage_arithmetic_is_exact():
    def row(params: float) -> RankMemory:
        return RankMemory(params=DtypeBytes(fp32=params), state_recorded=1.0)

    rows = [row(3e6), row(1e6), row(2e6), row(2e6)]
    stages = per_stage(rows, [0, 0, 1, 1], cuda=False)
    assert stages == {
        0: {"params_mb": 3.0, "grads_mb": 0.0, "optimizer_mb": 0.0},  # the max over its ranks, no spread keys
        1: {"params_mb": 2.0, "grads_mb": 0.0, "optimizer_mb": 0.0},
    }
    assert stage_metrics(rows, [1, 1, 0, 0], cuda=False)["stage0/params_mb"] == 2.0
    assert stage_metrics(rows, [0, None, 1, 1], cuda=False) == {}  # a rank without a label: no per-stage figures
    assert stage_metrics(rows, [None] * 4, cuda=False) == {}
    entries = [{"stage": k, "ranks": [2 * k, 2 * k + 1], **m} for k, m in stages.items()]
    table = stage_table(entries, ((0, 3), (1, 2)))
    assert [c.header for c in table.columns] == ["stages", "ranks", "parameters"]
    assert list(table.columns[0].cells) == ["0, 3", "1, 2"] and list(table.columns[2].cells) == ["3.00 MB", "2.00 MB"]


def test_no_pipeline_no_placement():
    assert AccelParallel().pipeline_stages is None  # before the processes start, and without a pipeline dimension


class _OneStage(SingleDeviceStrategy):
    """Lightning's own strategy plus the protocol: the monitor needs nothing of AccelParallel's."""

    @property
    def pipeline_stages(self) -> StagePlacement:
        return StagePlacement(0, ((0, 1),))


def test_any_strategy_with_the_protocol_gets_per_stage_figures(capsys):
    monitor = MemoryMonitor()
    trainer = pl.Trainer(strategy=_OneStage("cpu"), callbacks=[monitor], **small_trainer_kwargs(max_steps=1))
    trainer.fit(PipeModel(), DataLoader(dataset(8), batch_size=8))
    assert monitor.summary["stage0/params_mb"] == monitor.summary["params_mb"] == module_bytes(PipeModel()) / 1e6
    assert monitor.report["config"]["pipeline_stages"] == [[0, 1]]
    assert "memory per pipeline stage" in capsys.readouterr().out


@pytest.mark.parametrize(("stage", "error"), [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_a_bad_stage_label_is_refused(stage, error):
    with pytest.raises(error, match=rf"MemoryMeter\(stage={stage!r}\): expected an int >= 0 or None\. Fix"):
        MemoryMeter(stage=stage)
