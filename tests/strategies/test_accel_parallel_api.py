"""AccelParallel's surface: its registered name, LightningCLI YAML, validation through the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from lit_accel import AccelParallel
from tests.helpers import run_distributed
from tests.helpers.parallel import PipeModel, dataset
from tests.test_cli import _SCRIPT, QUIET

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


def test_registered_name_builds_the_strategy():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="accel_parallel", logger=False)
    assert type(trainer.strategy) is AccelParallel


def test_from_lightning_cli_yaml(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text("""
trainer:
  strategy:
    class_path: lit_accel.AccelParallel
    init_args:
      pipeline_parallel: 2
      tensor_parallel: 2
      schedule: zbv
      microbatches: 8
      stage_split: [net.2]
      tensor_plan: {net.0: colwise, net.3: rowwise}
      reduce_dtype: torch.bfloat16
""")  # fmt: skip
    cli = LightningCLI(_SCRIPT.CLIModel, _SCRIPT.CLIData, run=False, save_config_callback=None,
                       args=[*QUIET, "--config", str(config)])  # fmt: skip
    strategy = cli.trainer.strategy
    assert type(strategy) is AccelParallel
    plan = strategy.plan  # every argument of the layout reaches the strategy's readers through its plan
    assert (plan.layout.pipeline, plan.layout.tensor, plan.schedule.name) == (2, 2, "zbv")
    assert (plan.microbatches, list(plan.stage_split)) == (8, ["net.2"])
    assert dict(plan.tensor_plan) == {"net.0": "colwise", "net.3": "rowwise"}
    assert plan.reduce_dtype is torch.bfloat16


def _validate(rank: int, world: int, strategy_kwargs: dict[str, Any]) -> float:
    model = PipeModel()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=AccelParallel(**strategy_kwargs), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         max_steps=2, num_sanity_val_steps=2, val_check_interval=2,
                         use_distributed_sampler=False)  # fmt: skip
    trainer.fit(model, DataLoader(dataset(64), batch_size=8), DataLoader(dataset(32, seed=1), batch_size=8))
    return float(trainer.callback_metrics["val_loss"])


def test_validation_through_the_pipeline_equals_one_process():
    reference = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, enable_checkpointing=False, max_steps=2, num_sanity_val_steps=0,
                           val_check_interval=2)  # fmt: skip
    pl.seed_everything(0, verbose=False)
    model = PipeModel()
    pl.seed_everything(0, verbose=False)
    reference.fit(model, DataLoader(dataset(64), batch_size=8), DataLoader(dataset(32, seed=1), batch_size=8))
    want = float(reference.callback_metrics["val_loss"])
    torch.manual_seed(0)
    got = run_distributed(_validate, 2, {"pipeline_parallel": 2, "microbatches": 2}, init_process_group=False)
    assert got[0] == got[1]
    assert got[0] == pytest.approx(want, rel=1e-6)
