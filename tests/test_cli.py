"""LightningCLI: every public class people configure, from flags and from YAML, nested objects included, and a real job.

In process: ``LightningCLI(..., run=False)`` parses and builds the objects (and, for fp16, fits one process) so each
setting can be read back from the object it reached. Then one real job: ``tests/scripts/cli_train.py`` started with
``python`` on 2 CPU processes (Lightning's popen launcher starts rank 1 by re-running the command line); its final
weights must equal a one-process replay of the same global batches, which holds only if the CLI's strategy really
applied the global batch (accumulation 2), SyncBatchNorm and DDP. A misspelled argument in the same script must end
it at parse time, naming the argument, before a second process exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins import LayerSync, Precision
from lightning.pytorch.strategies import Strategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

import lit_accel
from lit_accel import (
    AccelDDP,
    AccelFSDP,
    AccelPrecision,
    AccelSyncBatchNorm,
    DynamicGradScaler,
    EfficiencyMonitor,
    LossScaleMonitor,
    NonFiniteGuard,
)
from lit_accel.utilities._compat import get_layer_sync
from tests.helpers import BNModel, make_dataset

# LightningCLI warns that pytest's own command line is there besides args=[...]
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "cli_train.py"
QUIET = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false"]  # fmt: skip


def _script_module() -> Any:
    spec = importlib.util.spec_from_file_location("cli_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SCRIPT = _script_module()


def _cli(args: list[str]) -> LightningCLI:
    return LightningCLI(_SCRIPT.CLIModel, _SCRIPT.CLIData, run=False, save_config_callback=None, args=args)


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------------- strategies


@pytest.mark.parametrize(
    ("name", "cls", "start_method"),
    [("accel_ddp", AccelDDP, "popen"), ("accel_ddp_spawn", AccelDDP, "spawn"), ("accel_fsdp", AccelFSDP, "popen")],
)
def test_registered_strategy_names_work_as_flags(name, cls, start_method):
    strategy = _cli([*QUIET, f"--trainer.strategy={name}"]).trainer.strategy
    assert type(strategy) is cls and strategy._start_method == start_method


def test_accel_ddp_from_flags_with_a_nested_sync_batchnorm_and_ddp_arguments():
    cli = _cli([*QUIET, "--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.global_batch_size=64",
                "--trainer.strategy.micro_batch_size=8", "--trainer.strategy.partial_window=lightning",
                "--trainer.strategy.comm_hook=torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
                "--trainer.strategy.sync_batchnorm=lit_accel.AccelSyncBatchNorm",
                "--trainer.strategy.sync_batchnorm.group_size=2", "--trainer.strategy.bucket_cap_mb=5",
                "--trainer.strategy.timeout=0:01:30"])  # fmt: skip
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AccelDDP)
    assert (strategy.global_batch_size, strategy.micro_batch_size) == (64, 8)
    assert strategy.partial_window == "lightning"
    assert strategy._comm_hook is default_hooks.fp16_compress_hook  # an import path becomes the function itself
    assert isinstance(strategy.parts.batchnorm_sync.plugin, AccelSyncBatchNorm) and strategy.sync_bn_group_size == 2
    # DDP's own arguments reach DistributedDataParallel; the ones left at DDP's defaults are not passed at all
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 5, "gradient_as_bucket_view": True}
    assert strategy._timeout.total_seconds() == 90


POWERSGD_YAML = """
trainer:
  strategy:
    class_path: lit_accel.AccelDDP
    init_args:
      global_batch_size: 32
      comm_hook: powersgd
      comm_state:
        class_path: torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState
        init_args: {process_group: null, matrix_approximation_rank: 2, start_powerSGD_iter: 3}
      sync_batchnorm:
        class_path: lit_accel.AccelSyncBatchNorm
        init_args: {group_size: 4}
"""


def test_accel_ddp_from_yaml_with_a_powersgd_state_and_a_sync_batchnorm(tmp_path):
    strategy = _cli([*QUIET, "--config", _yaml(tmp_path, POWERSGD_YAML)]).trainer.strategy
    assert isinstance(strategy, AccelDDP) and strategy.global_batch_size == 32
    state = strategy._comm_state
    assert isinstance(state, PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (2, 3)
    assert strategy._comm_hook == "powersgd" and strategy.sync_bn_group_size == 4


def test_a_comm_state_object_can_be_given_as_one_json_flag():
    # `comm_state` is typed `object | None`, so its init args cannot be spread over dotted flags; one JSON value works.
    state = json.dumps({"class_path": f"{PowerSGDState.__module__}.PowerSGDState",
                        "init_args": {"process_group": None, "matrix_approximation_rank": 3}})  # fmt: skip
    strategy = _cli([*QUIET, "--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.comm_hook=powersgd",
                     f"--trainer.strategy.comm_state={state}"]).trainer.strategy  # fmt: skip
    assert isinstance(strategy._comm_state, PowerSGDState) and strategy._comm_state.matrix_approximation_rank == 3


def test_accel_fsdp_from_flags():
    strategy = _cli([*QUIET, "--trainer.strategy=lit_accel.AccelFSDP", "--trainer.strategy.global_batch_size=64",
                     "--trainer.strategy.reduce_dtype=torch.bfloat16", "--trainer.strategy.shard_policy=1000",
                     "--trainer.strategy.activation_checkpointing=true", "--trainer.strategy.state_dict_type=sharded",
                     "--trainer.strategy.reshard_after_forward=false"]).trainer.strategy  # fmt: skip
    assert isinstance(strategy, AccelFSDP) and strategy.global_batch_size == 64
    assert strategy.reduce_dtype is torch.bfloat16
    assert (strategy.shard_policy, strategy.activation_checkpointing) == (1000, True)
    assert (strategy.state_dict_type, strategy.reshard_after_forward) == ("sharded", False)


def test_accel_fsdp_from_yaml_with_a_block_class_and_a_sync_batchnorm(tmp_path):
    config = _yaml(tmp_path, """
trainer:
  strategy:
    class_path: lit_accel.AccelFSDP
    init_args:
      shard_policy: torch.nn.Linear
      cpu_offload: true
      sync_batchnorm: {class_path: lit_accel.AccelSyncBatchNorm, init_args: {group_size: 2}}
""")  # fmt: skip
    strategy = _cli([*QUIET, "--config", config]).trainer.strategy
    assert isinstance(strategy, AccelFSDP)
    assert strategy.shard_policy is torch.nn.Linear and strategy.cpu_offload is True
    assert isinstance(strategy.parts.batchnorm_sync.plugin, AccelSyncBatchNorm) and strategy.sync_bn_group_size == 2


# ---------------------------------------------------------------------------------------------------- precision


def test_accel_precision_with_a_nested_dynamic_grad_scaler_from_flags():
    plugin = _cli([*QUIET, "--trainer.plugins=lit_accel.AccelPrecision", "--trainer.plugins.precision=16-mixed",
                   "--trainer.plugins.on_min_scale=warn", "--trainer.plugins.scaler=lit_accel.DynamicGradScaler",
                   "--trainer.plugins.scaler.init_scale=4096", "--trainer.plugins.scaler.hysteresis=3",
                   "--trainer.plugins.scaler.growth_interval=50", "--trainer.plugins.scaler.min_scale=16"]
                  ).trainer.precision_plugin  # fmt: skip
    assert isinstance(plugin, AccelPrecision) and isinstance(plugin.scaler, DynamicGradScaler)
    scaler = plugin.scaler
    assert (plugin.loss_scale, scaler.hysteresis, scaler.get_growth_interval(), scaler.min_scale) == (4096, 3, 50, 16)


FP16_YAML = """
seed_everything: 0
model: {overflow_at_step: 1}
trainer:
  max_steps: 4
  plugins:
    - class_path: lit_accel.AccelPrecision
      init_args:
        precision: 16-mixed
        scaler:
          class_path: lit_accel.DynamicGradScaler
          init_args: {init_scale: 1024, hysteresis: 2, growth_interval: 1000}
  callbacks:
    - class_path: lit_accel.LossScaleMonitor
      init_args: {logging_interval: 1, track_underflow: true}
    - class_path: lit_accel.EfficiencyMonitor
      init_args: {warmup_steps: 1, print_summary: false}
"""


def test_a_yaml_configured_fp16_fit_uses_the_nested_scaler_and_both_monitors(tmp_path):
    cli = _cli([*QUIET, "--config", _yaml(tmp_path, FP16_YAML), f"--trainer.default_root_dir={tmp_path}"])
    trainer = cli.trainer
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AccelPrecision) and isinstance(plugin.scaler, DynamicGradScaler)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    # hysteresis=2 reached the scaler: the overflow at step 1 was skipped without a back-off (torch's rule halves it)
    assert (plugin.skipped_steps, plugin.loss_scale) == (1, 1024.0)
    loss_scale = next(cb for cb in trainer.callbacks if isinstance(cb, LossScaleMonitor))
    efficiency = next(cb for cb in trainer.callbacks if isinstance(cb, EfficiencyMonitor))
    assert loss_scale.track_underflow and "amp/underflow_frac" in loss_scale.last_metrics
    assert (loss_scale.last_metrics["amp/skipped_steps"], loss_scale.last_metrics["amp/loss_scale"]) == (1, 1024.0)
    assert efficiency.summary["measured_steps"] == 4 - 1  # warmup_steps=1 reached the monitor
    assert torch.load(tmp_path / "rank0.pt", weights_only=False)["skipped_steps"] == 1  # the script's own dump


def test_the_config_lightningcli_saves_rebuilds_the_precision_plugin_and_its_scaler(tmp_path):
    cli = _cli([*QUIET, "--config", _yaml(tmp_path, FP16_YAML), "--trainer.plugins.precision=16"])  # Lightning's 16
    saved = cli.parser.dump(cli.config)  # what LightningCLI's SaveConfigCallback writes
    plugin_config = yaml.safe_load(saved)["trainer"]["plugins"][0]
    assert plugin_config["init_args"]["precision"] in (16, "16")  # Lightning's spelling, kept as given
    assert plugin_config["init_args"]["scaler"]["class_path"] == "lit_accel.DynamicGradScaler"
    plugin = _cli(["--config", _yaml(tmp_path, saved)]).trainer.precision_plugin
    assert type(plugin) is AccelPrecision and plugin.precision == "16-mixed"
    assert type(plugin.scaler) is DynamicGradScaler and (plugin.scaler.hysteresis, plugin.loss_scale) == (2, 1024.0)


# ---------------------------------------------------------------------------------------------------- callbacks


def test_both_monitors_as_trainer_callbacks_from_flags():
    callbacks = _cli([*QUIET, "--trainer.callbacks+=lit_accel.LossScaleMonitor",
                      "--trainer.callbacks.track_underflow=true", "--trainer.callbacks.skip_rate_threshold=0.2",
                      "--trainer.callbacks+=lit_accel.EfficiencyMonitor", "--trainer.callbacks.warmup_steps=5",
                      "--trainer.callbacks.peak_flops=1e12", "--trainer.callbacks.log_key_prefix=eff/",
                      "--trainer.callbacks.exact_comm_timing=true"]
                     ).trainer.callbacks  # fmt: skip
    loss_scale = next(cb for cb in callbacks if isinstance(cb, LossScaleMonitor))
    efficiency = next(cb for cb in callbacks if isinstance(cb, EfficiencyMonitor))
    assert loss_scale.track_underflow and loss_scale.meter.skip_rate_threshold == 0.2
    assert (efficiency.warmup_steps, efficiency.peak_flops, efficiency.log_key_prefix) == (5, 1e12, "eff/")
    assert efficiency.exact_comm_timing is True


# ---------------------------------------------------------------------------------------------------- every class

_TRAINER_KEYS = (("strategy", Strategy), ("plugins", Precision), ("plugins", LayerSync), ("callbacks", Callback))
# Arguments without a default, by class: a new public class with one must be listed here (the test says so).
_REQUIRED = {"AccelPrecision": {"precision": "bf16-mixed"}}


def _configurable() -> list[tuple[str, str]]:
    found = []
    for name in lit_accel.__all__:
        cls = getattr(lit_accel, name)
        key = next((key for key, base in _TRAINER_KEYS if isinstance(cls, type) and issubclass(cls, base)), None)
        if key is not None:
            found.append((name, key))
    return found


@pytest.mark.parametrize(("name", "key"), _configurable(), ids=[name for name, _ in _configurable()])
def test_every_public_strategy_plugin_and_callback_builds_from_its_class_path(name, key):
    # One JSON flag value per class (the form that also works for a strategy, see the #19682 canary below).
    value = json.dumps({"class_path": f"lit_accel.{name}", "init_args": _REQUIRED.get(name, {})})
    strategy = [] if key == "strategy" else ["--trainer.strategy=accel_ddp"]  # one that holds a layer sync
    try:
        trainer = _cli([*QUIET, *strategy, f"--trainer.{key}={value}"]).trainer
    except SystemExit:
        pytest.fail(f"lit_accel.{name} did not parse from its class path; if it has a required argument, add it to"
                    " _REQUIRED")  # fmt: skip
    cls = getattr(lit_accel, name)
    built = {"strategy": [trainer.strategy], "callbacks": trainer.callbacks}.get(key)
    if built is None:  # a plugin: the precision plugin, or the layer sync the connector put on the strategy
        built = [trainer.precision_plugin, get_layer_sync(trainer.strategy)]
    assert any(type(obj) is cls for obj in built), name


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "misspelled"),
    [
        (["--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.global_batch_sise=64"], "global_batch_sise"),
        (["--trainer.strategy=lit_accel.AccelFSDP", "--trainer.strategy.shard_polcy=1000"], "shard_polcy"),
        (["--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.sync_batchnorm=lit_accel.AccelSyncBatchNorm",
          "--trainer.strategy.sync_batchnorm.group_sise=2"], "group_sise"),
        (["--trainer.plugins=lit_accel.AccelPrecision", "--trainer.plugins.precison=16-mixed"], "precison"),
        (["--trainer.plugins=lit_accel.AccelPrecision", "--trainer.plugins.precision=16-mixed",
          "--trainer.plugins.scaler=lit_accel.DynamicGradScaler", "--trainer.plugins.scaler.hysterisis=2"],
         "hysterisis"),
        (["--trainer.callbacks+=lit_accel.LossScaleMonitor", "--trainer.callbacks.track_underflw=true"],
         "track_underflw"),
        (["--trainer.callbacks+=lit_accel.EfficiencyMonitor", "--trainer.callbacks.warmup_step=5"], "warmup_step"),
    ],
    ids=["AccelDDP", "AccelFSDP", "AccelSyncBatchNorm", "AccelPrecision", "DynamicGradScaler", "LossScaleMonitor",
         "EfficiencyMonitor"],
)  # fmt: skip
def test_a_misspelled_argument_fails_at_parse_time_naming_it(args, misspelled, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli([*QUIET, *args])
    assert exit_info.value.code == 2
    assert f"Option '{misspelled}' is not accepted" in capsys.readouterr().err


def test_a_misspelled_nested_key_in_yaml_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _cli([*QUIET, "--config", _yaml(tmp_path, POWERSGD_YAML.replace("group_size: 4", "group_sise: 4"))])
    assert "group_sise" in capsys.readouterr().err


def test_an_invalid_value_fails_with_lit_accels_message_before_fit():
    with pytest.raises(ValueError, match=r"AccelDDP\(global_batch_size=-3\): expected an int >= 1 or None\. Fix"):
        _cli([*QUIET, "--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.global_batch_size=-3"])


def test_print_config_round_trips_the_nested_objects(tmp_path, capsys):
    plugins = FP16_YAML.split("trainer:\n  max_steps: 4\n")[1]  # the plugin with its scaler, and the callbacks
    config = _yaml(tmp_path, POWERSGD_YAML + plugins)
    with pytest.raises(SystemExit):
        _cli([*QUIET, "--config", config, "--print_config"])
    printed = capsys.readouterr().out
    for name in ("AccelSyncBatchNorm", "PowerSGDState", "DynamicGradScaler", "LossScaleMonitor", "EfficiencyMonitor"):
        assert name in printed
    again = tmp_path / "printed.yaml"
    again.write_text(printed)
    with pytest.raises(SystemExit):
        _cli(["--config", str(again), "--print_config"])
    assert capsys.readouterr().out == printed
    strategy = _cli(["--config", str(again)]).trainer.strategy
    assert strategy.sync_bn_group_size == 4 and strategy._comm_state.matrix_approximation_rank == 2
    assert cli_scaler_settings(_cli(["--config", str(again)])) == (1024.0, 2)


def cli_scaler_settings(cli: LightningCLI) -> tuple[float, int]:
    plugin = cli.trainer.precision_plugin
    return plugin.loss_scale, plugin.scaler.hysteresis


def test_a_bare_class_path_flag_is_read_as_a_strategy_name_lightning_19682(tmp_path):
    # Canary for Lightning #19682: Trainer(strategy: str | Strategy) lets jsonargparse read a lone class path as a
    # name. When this test fails, upstream fixed it: README's "With LightningCLI" advice can be simplified.
    with pytest.raises(ValueError, match=re.escape("invalid strategy name: `strategy='lit_accel.accelddp'`")):
        _cli([*QUIET, "--trainer.strategy=lit_accel.AccelDDP"])
    # What works instead: a registered name, or the class path followed by any of its arguments.
    assert isinstance(_cli([*QUIET, "--trainer.strategy=accel_ddp"]).trainer.strategy, AccelDDP)
    # A config that sets the strategy, overridden one argument at a time, keeps its other arguments...
    config = _yaml(tmp_path, POWERSGD_YAML)
    kept = _cli([*QUIET, "--config", config, "--trainer.strategy.global_batch_size=64"]).trainer.strategy
    assert (kept.global_batch_size, kept.sync_bn_group_size) == (64, 4)
    # ...while repeating the class path on the command line starts it over from the defaults.
    restarted = _cli([*QUIET, "--config", config, "--trainer.strategy=lit_accel.AccelDDP",
                      "--trainer.strategy.global_batch_size=64"]).trainer.strategy  # fmt: skip
    assert (restarted.global_batch_size, restarted.sync_bn_group_size) == (64, None)


# ---------------------------------------------------------------------------------------------------- README.md


def _readme_section() -> str:
    readme = (REPO / "README.md").read_text()
    return readme.split("## With LightningCLI", 1)[1].split("\n## ", 1)[0]


def test_the_readme_yaml_builds_what_it_shows(tmp_path):
    text = re.search(r"```yaml\n(.*?)```", _readme_section(), re.DOTALL).group(1)
    cli = _cli([*QUIET, "--config", _yaml(tmp_path, text)])
    strategy, plugin = cli.trainer.strategy, cli.trainer.precision_plugin
    assert isinstance(strategy, AccelDDP) and strategy.global_batch_size == 1024 and strategy.sync_bn_group_size == 8
    assert isinstance(strategy._comm_state, PowerSGDState) and strategy._comm_state.matrix_approximation_rank == 2
    assert isinstance(plugin, AccelPrecision) and isinstance(plugin.scaler, DynamicGradScaler)
    assert plugin.precision == "16-mixed" and plugin.scaler.hysteresis == 2
    names = [type(callback).__name__ for callback in cli.trainer.callbacks]
    assert "LossScaleMonitor" in names and "EfficiencyMonitor" in names


def test_the_readme_flags_build_what_they_show():
    flags = re.search(r"The same from flags: `(.*?)`;", _readme_section(), re.DOTALL).group(1)
    cli = _cli([*QUIET, *flags.split()])
    strategy, plugin = cli.trainer.strategy, cli.trainer.precision_plugin
    assert isinstance(strategy, AccelDDP) and strategy.global_batch_size == 1024
    assert isinstance(plugin.scaler, DynamicGradScaler) and plugin.scaler.hysteresis == 2
    assert any(isinstance(callback, LossScaleMonitor) for callback in cli.trainer.callbacks)
    job = re.search(r"trains a real 2-process job from `(.*?)`", _readme_section(), re.DOTALL).group(1)
    assert job.split() == JOB_FLAGS  # what the real job below runs


# ---------------------------------------------------------------------------------------------------- a real job

STEPS, MICRO, GLOBAL, RANKS = 3, 4, 16, 2
JOB_YAML = """
seed_everything: 0
trainer:
  max_steps: {steps}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  use_distributed_sampler: false
  default_root_dir: {out}
  callbacks:
    - class_path: lit_accel.EfficiencyMonitor
      init_args: {{warmup_steps: 1, report_path: {out}/efficiency.json, print_summary: false}}
    - class_path: lit_accel.NonFiniteGuard
data:
  batch_size: {micro}
"""
# The acceptance command of the issue, plus one argument of the strategy (see the canary test above for why).
JOB_FLAGS = ["--trainer.strategy=lit_accel.AccelDDP", f"--trainer.strategy.global_batch_size={GLOBAL}",
             f"--trainer.devices={RANKS}", "--trainer.accelerator=cpu"]  # fmt: skip


def _start(args: list[str]) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("MASTER_PORT", None)  # let Lightning pick a free port
    command = [sys.executable, str(SCRIPT), "fit", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, time.monotonic()


def _finish(proc: subprocess.Popen, started: float, timeout: float) -> tuple[int, str, float]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the job did not end within {timeout:.0f} s:\n{output[-4000:]}")
    return proc.returncode, output, time.monotonic() - started


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cli_job")
    out, configs = root / "out", root / "configs"
    out.mkdir()
    configs.mkdir()
    config = configs / "job.yaml"  # not in default_root_dir: LightningCLI saves the resolved config.yaml there
    config.write_text(JOB_YAML.format(steps=STEPS, micro=MICRO, out=out))
    typo = [*JOB_FLAGS[:1], "--trainer.strategy.global_batch_sise=16", *JOB_FLAGS[2:]]
    started = {"train": _start(["--config", str(config), *JOB_FLAGS]), "typo": _start(["--config", str(config), *typo])}
    finished = {name: _finish(*proc_start, timeout=240) for name, proc_start in started.items()}
    return {"out": out, **finished}


def _replay() -> dict[str, torch.Tensor]:
    """The job in one process: each optimizer step averages two micro-batches of the two ranks' joint batch of 8.

    A non-shuffling DistributedSampler gives rank r the samples r, r+2, ...: micro-batch m of both ranks together is
    samples 8m..8m+7, and SyncBatchNorm normalises over exactly those, as plain BatchNorm does here.
    """
    pl.seed_everything(0, verbose=False)
    model = BNModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_dataset(64).tensors
    joint, accumulation = MICRO * RANKS, GLOBAL // (MICRO * RANKS)
    for step in range(STEPS):
        for micro in range(accumulation):
            rows = slice((step * accumulation + micro) * joint, (step * accumulation + micro + 1) * joint)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def test_the_cli_job_trains_two_processes_with_the_configured_global_batch(jobs):
    returncode, output, _ = jobs["train"]
    assert returncode == 0, output[-4000:]
    assert f"AccelDDP: global batch {GLOBAL} = {MICRO} loaded x 2 accumulation x {RANKS} data-parallel ranks" in output
    dumps = [torch.load(jobs["out"] / f"rank{rank}.pt", weights_only=False) for rank in range(RANKS)]
    for dump in dumps:
        assert (dump["world_size"], dump["global_step"], dump["strategy"]) == (RANKS, STEPS, "AccelDDP")
        assert (dump["accumulate_grad_batches"], dump["global_batch_size"]) == (GLOBAL // (MICRO * RANKS), GLOBAL)
        assert dump["precision_plugin"] == "Precision"  # full precision: Lightning's own plugin
        assert "EfficiencyMonitor" in dump["callbacks"] and "NonFiniteGuard" in dump["callbacks"]
    reference = _replay()
    for key, value in reference.items():
        assert torch.equal(dumps[0]["state_dict"][key], dumps[1]["state_dict"][key]), key
        torch.testing.assert_close(dumps[0]["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    report = json.loads((jobs["out"] / "efficiency.json").read_text())
    assert report["config"]["world_size"] == RANKS and report["config"]["accumulate_grad_batches"] == 2
    assert report["averages"]["measured_steps"] == STEPS - 1


def test_the_config_the_job_saved_rebuilds_the_same_strategy(jobs, tmp_path):
    saved = yaml.safe_load((jobs["out"] / "config.yaml").read_text())  # LightningCLI's SaveConfigCallback, rank 0
    assert saved["trainer"]["strategy"]["init_args"]["global_batch_size"] == GLOBAL
    # The in-process parser has no `fit` subcommand, so no ckpt_path/weights_only: keep what it knows.
    known = {key: value for key, value in saved.items() if key in ("seed_everything", "trainer", "model", "data")}
    cli = _cli(["--config", _yaml(tmp_path, yaml.safe_dump(known))])
    assert isinstance(cli.trainer.strategy, AccelDDP) and cli.trainer.strategy.global_batch_size == GLOBAL
    assert cli.trainer.num_devices == RANKS and any(isinstance(cb, NonFiniteGuard) for cb in cli.trainer.callbacks)


def test_a_misspelled_argument_ends_the_job_before_a_second_process_starts(jobs):
    returncode, output, _ = jobs["typo"]
    assert returncode == 2, output[-4000:]
    assert "Option 'global_batch_sise' is not accepted" in output
    assert "Initializing distributed" not in output and "GLOBAL_RANK" not in output
