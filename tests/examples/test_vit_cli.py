"""``examples/vit_cli.py``: the ViT case study as a LightningCLI program, from examples/configs/vit_digits_cli.yaml.

In process, the shipped YAML must build the objects it names (and flags must reach nested ones); as a real job, two
CPU processes train from it with the global batch the YAML sets; the full default run (slow) reaches 90% on digits.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import Precision
from torch.utils.flop_counter import FlopCounterMode

from lit_accel import AccelDDP, AccelPrecision, DynamicGradScaler, EfficiencyMonitor, LossScaleMonitor, NonFiniteGuard
from tests.examples._scripts import imported_example, unexpected_stderr_lines

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPT = EXAMPLES / "vit_cli.py"
CONFIG = EXAMPLES / "configs" / "vit_digits_cli.yaml"
# README.md, "With LightningCLI": the tests run these, adding only --output_dir and a quiet progress bar.
README_RUN = "python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml"
README_TWO_PROCESSES = f"{README_RUN} --trainer.devices=2 --trainer.max_steps=4"


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """The YAML's cpu_threads sets this process's intra-op threads and OMP_NUM_THREADS: undo both after each test."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vit_cli():
    """The CLI script imported as a module (it imports ``vit`` and ``_vit_data`` from its own folder)."""
    with imported_example(SCRIPT, "vit_cli_example") as module:
        yield module


def _build(vit_cli, tmp_path: Path, *flags: str):
    return vit_cli.ViTCLI(vit_cli.ViTClassifier, vit_cli.ViTData, run=False, save_config_callback=None,
                          args=["--config", str(CONFIG), f"--output_dir={tmp_path}", *flags])  # fmt: skip


def _run(readme_command: str, output_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    env.pop("MASTER_PORT", None)
    extra = [f"--output_dir={output_dir}", "--trainer.enable_progress_bar=false"]
    command = [sys.executable, *shlex.split(readme_command)[1:], *extra]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _val_acc(path: Path) -> list[float]:
    with open(path) as file:
        return [float(row["val/acc"]) for row in csv.DictReader(file) if row.get("val/acc")]


def test_the_readme_shows_the_commands_these_tests_run():
    readme = (REPO / "README.md").read_text()
    assert README_RUN + "\n" in readme and README_TWO_PROCESSES + "\n" in readme


def test_the_shipped_yaml_builds_the_case_studys_objects(vit_cli, tmp_path):
    cli = _build(vit_cli, tmp_path)
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    strategy = trainer.strategy
    assert isinstance(strategy, AccelDDP) and (strategy.global_batch_size, strategy.micro_batch_size) == (32, 16)
    assert type(trainer.precision_plugin) is Precision and trainer.precision == "32-true"  # fp32: Lightning's own
    assert any(isinstance(cb, NonFiniteGuard) for cb in trainer.callbacks)
    assert (trainer.max_epochs, trainer.gradient_clip_val, trainer.log_every_n_steps) == (30, 1.0, 10)
    efficiency = next(cb for cb in trainer.callbacks if isinstance(cb, EfficiencyMonitor))
    assert efficiency.report_path == tmp_path / "efficiency.json"  # linked from --output_dir
    assert any(isinstance(cb, LossScaleMonitor) for cb in trainer.callbacks)
    assert any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks)
    assert isinstance(trainer.logger, CSVLogger) and Path(trainer.logger.log_dir) == tmp_path
    assert Path(trainer.default_root_dir) == tmp_path
    # the data's shape reached the model through the CLI's links
    assert (data.num_classes, data.in_chans, data.batch_size) == (10, 1, 16)
    assert (model.hparams.lr, model.hparams.num_classes, model.hparams.in_chans) == (2e-3, 10, 1)
    assert model(torch.zeros(2, 1, 16, 16)).shape == (2, 10)
    assert torch.get_num_threads() == 1  # cpu_threads: 1


def test_flags_reach_nested_objects_and_links_follow_the_model(vit_cli, tmp_path):
    cli = _build(vit_cli, tmp_path, "--trainer.plugins=lit_accel.AccelPrecision",
                 "--trainer.plugins.precision=16-mixed", "--trainer.plugins.scaler=lit_accel.DynamicGradScaler",
                 "--trainer.plugins.scaler.hysteresis=2", "--trainer.strategy.global_batch_size=64",
                 "--model.model_name=resnet18", "--data.img_size=32", "--model.lr=1e-3")  # fmt: skip
    plugin, strategy = cli.trainer.precision_plugin, cli.trainer.strategy
    assert isinstance(plugin, AccelPrecision) and plugin.precision == "16-mixed"
    assert isinstance(plugin.scaler, DynamicGradScaler)
    assert plugin.scaler.hysteresis == 2
    assert strategy.global_batch_size == 64 and strategy.micro_batch_size == 16  # the YAML's other argument is kept
    assert cli.datamodule.spec.train.tensors[0].shape[-1] == 32 and cli.model.hparams.lr == 1e-3
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in cli.model.net.modules()) > 0  # a resnet18 was built


def test_a_misspelled_key_is_named_before_anything_starts(vit_cli, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _build(vit_cli, tmp_path, "--trainer.strategy.global_batch_sise=64")
    assert exit_info.value.code == 2
    assert "Option 'global_batch_sise' is not accepted" in capsys.readouterr().err


def test_a_global_batch_that_cannot_divide_stops_before_any_process_starts(vit_cli, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        vit_cli.ViTCLI(vit_cli.ViTClassifier, vit_cli.ViTData, save_config_callback=None,
                       args=["fit", "--config", str(CONFIG), f"--output_dir={tmp_path}", "--trainer.devices=2",
                             "--trainer.strategy.global_batch_size=48"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: AccelDDP(global_batch_size=48) cannot be split into loaded batches of 16 x 2")
    assert err[-1].endswith("Fix: global_batch_size=32 (1 accumulation step) or 64 (2 accumulation steps), or a train"
                            " dataloader batch_size of 12 or 24.")  # fmt: skip
    assert not (tmp_path / "metrics.csv").exists()  # nothing ran


def test_the_model_summary_counts_the_forward_flops_of_one_image(vit_cli, tmp_path):
    from lightning.pytorch.utilities.model_summary import ModelSummary

    model = _build(vit_cli, tmp_path).model
    assert tuple(model.example_input_array.shape) == (1, 1, 16, 16)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()
        model(model.example_input_array)
    assert ModelSummary(model).total_flops == counter.get_total_flops() > 0


def test_two_cpu_processes_train_from_the_yaml(tmp_path):
    proc = _run(README_TWO_PROCESSES, tmp_path, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "AccelDDP: global batch 32 = 16 loaded x 1 accumulation x 2 data-parallel ranks" in output
    # a quiet console: upstream lines, our notes, and the YAML's LossScaleMonitor saying once that fp32 has no scale
    fp32_note = r"LossScaleMonitor: nothing to log: precision '32-true' .*"
    assert unexpected_stderr_lines(proc.stderr, (fp32_note,)) == [], proc.stderr[-4000:]
    # the training curves, from the run's metrics: the validation at the stop is the one metrics.csv holds
    history = json.loads((tmp_path / "training.json").read_text())
    assert (tmp_path / "training.png").stat().st_size > 0
    assert [v["val_acc"] for v in history["validations"]] == pytest.approx(_val_acc(tmp_path / "metrics.csv"))
    assert [row["step"] for row in history["steps"]] == []  # 4 steps, logging every 10: no training point yet
    flops = re.search(r"Total FLOPs: ([\d.]+) ?([KMGT]?)", output)
    assert flops and float(flops.group(1)) > 0, output[-3000:]
    assert re.search(r"validation accuracy \d+\.\d+% after 4 optimizer steps", output)
    report = json.loads((tmp_path / "efficiency.json").read_text())
    assert (report["config"]["world_size"], report["config"]["accumulate_grad_batches"]) == (2, 1)
    assert report["averages"]["samples_per_sec"] > 0
    assert len(_val_acc(tmp_path / "metrics.csv")) == 1  # the closing validation of the final weights
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["class_path"] == "lit_accel.AccelDDP"
    assert saved["trainer"]["strategy"]["init_args"]["global_batch_size"] == 32
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == 4


@pytest.mark.slow
def test_the_readme_command_reaches_90_percent_on_digits(tmp_path):
    # README.md, "With LightningCLI": the shipped config, one CPU process, 30 epochs.
    proc = _run(README_RUN, tmp_path, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    accuracies = _val_acc(tmp_path / "metrics.csv")
    print(f"\nvit_cli digits: final val/acc={accuracies[-1]:.4f} over {len(accuracies)} validations")
    assert len(accuracies) == 30 and accuracies[-1] >= 0.90
