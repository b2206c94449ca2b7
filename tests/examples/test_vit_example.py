"""``examples/vit.py``: the real CLI in subprocesses (two gloo processes, torchrun, bad flags) and its building blocks.

The CLI tests run the script exactly as a user would (``python examples/vit.py ...``), read what it writes to
``--output-dir`` (``results.json``, ``metrics.csv``, ``config.yaml``) and check stdout only for the final table.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.examples._scripts import imported_example, unexpected_stderr_lines

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPT = EXAMPLES / "vit.py"
TABLE_TITLE = "ViT case study: results"


@pytest.fixture(scope="module")
def vit():
    """The example script imported as a module (its helper ``_vit_data`` sits next to it)."""
    with imported_example(SCRIPT, "vit_example") as module:
        yield module


@pytest.fixture(scope="module")
def vit_data(vit):
    """``examples/_vit_data.py``, the data helpers the script imports."""
    return sys.modules["_vit_data"]


def _run(args: list[str], timeout: float, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    env.pop("OMP_NUM_THREADS", None)  # let the launcher pick one thread per process
    env.pop("LIT_ACCEL_EXAMPLE_RUN_DIR", None)  # an in-process run of this session left it for its own children
    command = [*(launcher or [sys.executable]), str(SCRIPT), *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _fail_message(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def _assert_quiet(stderr: str) -> None:
    """Only listed upstream lines and our notes, no warning of ours."""
    assert unexpected_stderr_lines(stderr) == [], stderr[-4000:]


def _only_run(output: Path) -> Path:
    """The one run folder a run with ``--output output`` made."""
    (run,) = [path for path in output.iterdir() if path.is_dir()]
    return run


def _metric_rows(path: Path, key: str) -> list[float]:
    with open(path) as file:
        return [float(row[key]) for row in csv.DictReader(file) if row.get(key)]


# ----------------------------------------------------------------------------------------------------------------------
# The real CLI
# ----------------------------------------------------------------------------------------------------------------------
def test_cli_two_cpu_processes_train_and_print_the_final_table(tmp_path, vit):
    # The acceptance command of issue #8: Lightning's launcher re-runs the script for rank 1, AccelDDP joins them.
    proc = _run(
        [
            "--accelerator", "cpu", "--devices", "2", "--max-steps", "4", "--data", "synthetic",
            "--model", "vit_tiny_patch16_224", "--img-size", "32", "--batch-size", "8",
            "--output-dir", str(tmp_path),
        ],
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, _fail_message(proc)
    assert TABLE_TITLE in proc.stdout, _fail_message(proc)
    assert "Traceback" not in proc.stderr
    _assert_quiet(proc.stderr)
    tmp_path = _only_run(tmp_path)  # --output-dir is the parent of the run folder (timm's --output)
    # the model summary ran one example image through the model (it printed "Total FLOPs: 0" without one)
    flops = re.search(r"Total FLOPs: ([\d.]+)", proc.stdout)
    assert flops and float(flops.group(1)) > 0, _fail_message(proc)

    results = json.loads((tmp_path / "results.json").read_text())
    accumulate = vit.IMAGENET_DEFAULTS["accumulate"]  # the seed's 4-step accumulation is the non-digits default
    assert results["world_size"] == 2
    assert results["strategy"] == "accel_ddp"
    assert results["accumulate"] == accumulate
    assert results["global_batch_size"] == 8 * 2 * accumulate
    assert results["optimizer_steps"] == 4
    assert results["precision"] == "32-true"
    assert results["skipped_steps"] == 0
    assert results["batchnorm_layers"] == results["sync_batchnorm_layers"] == 0  # a ViT has no BatchNorm
    assert 0.0 <= results["val_acc"] <= 1.0
    efficiency = json.loads((tmp_path / "efficiency.json").read_text())
    assert results["samples_per_sec"] == pytest.approx(efficiency["averages"]["samples_per_sec"])
    memory = json.loads((tmp_path / "memory.json").read_text())  # MemoryMonitor's report, every rank's bytes
    assert memory["summary"]["params_mb"] > 0
    # each report has its picture beside it (matplotlib is in the test extra)
    assert (tmp_path / "efficiency.png").stat().st_size > 0 and (tmp_path / "memory.png").stat().st_size > 0
    assert results["samples_per_sec"] > 0

    # CSV logs, checkpoint, efficiency report and the resolved configuration are all in --output-dir.
    # (4 steps are fewer than the logging interval: the CSV holds the closing validation, the results the last loss)
    assert _metric_rows(tmp_path / "metrics.csv", "val/acc") == pytest.approx([results["val_acc"]])
    assert math.isfinite(results["train_loss"])
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4
    assert results["output_dir"] == str(tmp_path)
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["model"] == "vit_tiny_patch16_224"
    assert config["accumulate"] == accumulate


def test_torchrun_two_cpu_processes_with_syncbn_on_a_batchnorm_model(tmp_path):
    # torchrun starts both ranks itself; ResNet-18 has BatchNorm layers, so AccelDDP's SyncBN has work to do.
    proc = _run(
        [
            "--accelerator", "cpu", "--devices", "2", "--max-steps", "3", "--data", "digits",
            "--model", "resnet18", "--batch-size", "16", "--output", str(tmp_path),
        ],
        timeout=240,
        launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    )  # fmt: skip
    assert proc.returncode == 0, _fail_message(proc)
    assert TABLE_TITLE in proc.stdout, _fail_message(proc)
    assert "BatchNorm layers, synchronised across 2 devices" in proc.stdout
    results = json.loads((_only_run(tmp_path) / "results.json").read_text())  # rank 1 made no folder of its own
    assert results["world_size"] == 2
    # every BatchNorm of the model was a SyncBatchNorm while fitting (counted in on_train_start)
    assert results["sync_batchnorm_layers"] == results["batchnorm_layers"] > 0
    assert results["optimizer_steps"] == 3
    assert results["global_batch_size"] == 16 * 2


def test_fp8_mixed_trains_the_digits_vit_and_evaluates(tmp_path):
    proc = _run(["--max-steps", "3", "--precision", "fp8-mixed", "--output", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, _fail_message(proc)
    # every Linear of the blocks converts (emulated on CPU); the 10-class head cannot (10 is no multiple of 16)
    assert re.search(r"FP8 \(torchao, emulated on cpu.*\): 16 of 17 Linear layers converted", proc.stdout + proc.stderr)
    results = json.loads((_only_run(tmp_path) / "results.json").read_text())
    assert results["precision"] == "fp8-mixed" and math.isfinite(results["train_loss"])
    assert 0.0 <= results["val_acc"] <= 1.0  # the closing validation ran (outside inference mode, see precision.md)


def test_cli_global_batch_not_divisible_is_a_one_line_error(tmp_path):
    proc = _run(
        ["--accelerator", "cpu", "--devices", "2", "--batch-size", "8", "--global-batch-size", "100",
         "--output-dir", str(tmp_path)],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, _fail_message(proc)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --global-batch-size 100 is not divisible by")
    assert "8 x 2 devices = 16" in lines[0]
    # lit_accel's plan names the nearest valid choices, in the flags' words
    assert lines[0].endswith("Fix: --global-batch-size 96 or 112, or --batch-size 5 or 10"), lines[0]
    assert not any(tmp_path.iterdir())  # said before any process started: no run folder


@pytest.mark.slow
def test_default_cpu_run_reaches_90_percent_on_digits(tmp_path):
    # The default command without a GPU (issue #8 acceptance): a small ViT on scikit-learn's digits.
    start = time.perf_counter()
    proc = _run(["--accelerator", "cpu", "--output", str(tmp_path)], timeout=900)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, _fail_message(proc)
    results = json.loads((_only_run(tmp_path) / "results.json").read_text())
    print(f"\ndigits default: val_acc={results['val_acc']:.4f} fit={results['fit_seconds']:.1f}s wall={elapsed:.1f}s")
    assert results["data"] == "digits"
    assert results["val_acc"] >= 0.90


# ----------------------------------------------------------------------------------------------------------------------
# Argument handling, in process
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "vit_bse_patch16_224"], "--model 'vit_bse_patch16_224' is not a timm model"),
        (["--data", "/no/such/imagenet"], "--data '/no/such/imagenet' is neither 'synthetic', 'digits' nor"),
        (["--devices", "two"], "--devices 'two' must be a number"),
        (["--batch-size", "8", "--global-batch-size", "64", "--accumulate", "2"], "--accumulate 2 contradicts"),
        (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["--devices", "0"], "--devices 0 selects no device"),
        (["--strategy", "accel_ddp_spawn"], "--strategy 'accel_ddp_spawn' trains in multiprocessing children"),
    ],
)
def test_bad_flags_are_one_line_errors(vit, capsys, argv, expected):
    assert vit.main(["--accelerator", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err


def test_unknown_model_suggests_close_names(vit, capsys):
    assert vit.main(["--accelerator", "cpu", "--model", "vit_bse_patch16_224"]) == 2
    assert "did you mean vit_base_patch16_224" in capsys.readouterr().err


def test_missing_image_folder_split_is_named(vit, tmp_path, capsys):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    assert vit.main(["--accelerator", "cpu", "--data", str(tmp_path)]) == 2
    assert "has no val/ folder" in capsys.readouterr().err


def test_cpu_defaults_are_the_digits_preset(vit):
    args = vit.parse_args(["--accelerator", "cpu"])
    assert args.data == "digits"
    assert args.model == vit.DIGITS_MODEL
    for key, value in vit.DIGITS_DEFAULTS.items():
        if key != "batch_size":
            assert getattr(args, key) == value, key
    assert args.batch_size * args.world_size * args.accumulate == vit.DIGITS_GLOBAL_BATCH
    # two processes keep the 32-image optimizer step: 16 per device
    two = vit.parse_args(["--accelerator", "cpu", "--devices", "2"])
    assert (two.batch_size, two.accumulate, two.strategy) == (vit.DIGITS_GLOBAL_BATCH // 2, 1, "accel_ddp")
    assert args.precision == "32-true"
    assert args.devices == vit.CPU_DEVICES
    assert args.strategy == ("accel_ddp" if vit.CPU_DEVICES > 1 else "auto")


def test_imagenet_shaped_defaults_follow_the_seed_recipe(vit):
    # Section 7 of the seed: ViT-B/16 at 224 px, 128 per device, 4-step accumulation, AdamW lr 3e-4, wd 0.05, clip 1.
    args = vit.parse_args(["--accelerator", "cpu", "--data", "synthetic", "--devices", "2"])
    assert (args.model, args.img_size) == ("vit_base_patch16_224", 224)
    assert (args.batch_size, args.accumulate, args.lr, args.weight_decay, args.clip_grad) == (128, 4, 3e-4, 0.05, 1.0)
    assert args.sync_bn is True
    assert args.strategy == "accel_ddp"
    assert args.epochs == vit.SYNTHETIC_EPOCHS


def test_global_batch_sets_the_accumulation(vit):
    args = vit.parse_args(["--accelerator", "cpu", "--devices", "2", "--batch-size", "8", "--global-batch-size", "64"])
    assert args.accumulate == 64 // (8 * 2)
    assert args.world_size == 2


def test_config_file_round_trips_and_flags_override_it(vit, tmp_path):
    args = vit.parse_args(["--accelerator", "cpu", "--lr", "0.01", "--epochs", "3", "--no-sync-bn"])
    path = tmp_path / "config.yaml"
    vit.save_config(args, path)
    again = vit.parse_args(["--config", str(path)])
    assert {k: v for k, v in vars(again).items() if k != "config"} == {
        k: v for k, v in vars(args).items() if k != "config"
    }
    assert vit.parse_args(["--config", str(path), "--epochs", "5"]).epochs == 5


def test_shipped_seed_recipe_config_resolves_to_the_seed_numbers(vit):
    # examples/configs/vit_b16_imagenet.yaml on 8 devices: 128 x 8 x 4 = 4096, as in the seed's section 7.
    config = str(EXAMPLES / "configs" / "vit_b16_imagenet.yaml")
    args = vit.parse_args(["--config", config, "--data", "synthetic", "--accelerator", "cpu"])
    assert (args.model, args.batch_size, args.world_size, args.accumulate) == ("vit_base_patch16_224", 128, 8, 4)
    assert (args.precision, args.lr, args.weight_decay, args.clip_grad) == ("16-mixed", 3e-4, 0.05, 1.0)
    assert args.epochs == 90


def test_config_file_with_unknown_keys_is_refused(vit, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: 4\nlearning_rate: 0.1\n")
    assert vit.main(["--config", str(path)]) == 2
    assert "unknown settings ['learning_rate']" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Data and models
# ----------------------------------------------------------------------------------------------------------------------
def test_digits_split_is_fixed_stratified_and_standardised(vit_data):
    from sklearn.datasets import load_digits

    _vit_data = vit_data
    spec = _vit_data.digits_datasets(16)
    again = _vit_data.digits_datasets(16)
    train_x, train_y = spec.train.tensors
    val_x, val_y = spec.val.tensors
    total = len(load_digits().target)
    assert len(train_y) + len(val_y) == total
    assert len(val_y) == math.ceil(total * _vit_data.DIGITS_VAL_FRACTION)  # scikit-learn rounds the test share up
    assert train_x.shape[1:] == (1, 16, 16)
    # stratified: every class is split in the same proportion (to within one image)
    for label in range(10):
        n_train, n_val = int((train_y == label).sum()), int((val_y == label).sum())
        assert abs(n_val - _vit_data.DIGITS_VAL_FRACTION * (n_train + n_val)) <= 1
    # fixed: the same split and values every time, whatever the global seed
    torch.manual_seed(123)
    assert torch.equal(again.val.tensors[0], val_x) and torch.equal(again.val.tensors[1], val_y)
    # standardised with the training set's statistics
    assert float(train_x.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(train_x.std()) == pytest.approx(1.0, abs=1e-4)


def test_synthetic_images_are_deterministic_and_learnable(vit_data):
    _vit_data = vit_data
    data = _vit_data.SyntheticImages(num_samples=1000, img_size=8, num_classes=10)
    other = _vit_data.SyntheticImages(num_samples=1000, img_size=8, num_classes=10)
    pool = len(data.images)
    image, label = data[3]
    assert torch.equal(image, other[3][0])
    # the same image always carries the same label, so there is something to learn
    assert torch.equal(data[3 + pool][0], image) and data[3 + pool][1] == label


def test_models_take_the_data_shape_and_count_batchnorms(vit):
    digits_vit = vit.build_model(vit.DIGITS_MODEL, num_classes=10, in_chans=1, img_size=16)
    resnet = vit.build_model("resnet18", num_classes=10, in_chans=1, img_size=16)  # takes no img_size argument
    images = torch.randn(2, 1, 16, 16)
    assert digits_vit(images).shape == (2, 10)
    assert resnet(images).shape == (2, 10)
    assert vit.count_batchnorms(digits_vit) == 0  # the seed's SyncBN conversion of a ViT converts nothing
    assert vit.count_batchnorms(resnet) == sum(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules()) > 0


@pytest.mark.parametrize(("name", "img_size"), [("vit_digits", 16), ("resnet18", 32)])
def test_the_model_summary_counts_the_flops_of_one_example_image(vit, name, img_size):
    from lightning.pytorch.utilities.model_summary import ModelSummary
    from torch.utils.flop_counter import FlopCounterMode

    net = vit.build_model(name, num_classes=10, in_chans=1, img_size=img_size)
    module = vit.ImageClassifier(net, 10, 1e-3, 0.05, None, input_shape=(1, img_size, img_size))
    assert tuple(module.example_input_array.shape) == (1, 1, img_size, img_size)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net.eval()
        net(torch.zeros(1, 1, img_size, img_size))
    assert ModelSummary(module).total_flops == counter.get_total_flops() > 0


def _image_folder(root: Path, classes: int, per_class: dict[str, int]) -> Path:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, count in per_class.items():
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = torch.randint(0, 256, (40, 48, 3), generator=generator, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{index}.png")
    return root


def test_image_folder_uses_timm_transforms_and_trains(vit, vit_data, tmp_path, monkeypatch):
    import timm

    root = _image_folder(tmp_path / "data", classes=3, per_class={"train": 4, "val": 2})
    spec = vit_data.folder_datasets(root, timm.get_pretrained_cfg("resnet18").to_dict(), img_size=32)
    assert (spec.num_classes, len(spec.train), len(spec.val)) == (3, 12, 6)
    # timm's recipes: random-resized crop for training, resize + centre crop for validation, both to --img-size
    assert "RandomResizedCrop" in repr(spec.train.transform)
    assert "CenterCrop" in repr(spec.val.transform)
    assert spec.train[0][0].shape == spec.val[0][0].shape == (3, 32, 32)

    # The whole script in this process, on the small ViT (a ResNet's first CPU convolutions alone take seconds).
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # keep the script off this process's threads
    out = tmp_path / "run"
    argv = ["--accelerator", "cpu", "--data", str(root), "--model", vit.DIGITS_MODEL, "--img-size", "16"]
    argv += ["--batch-size", "4", "--accumulate", "1", "--max-steps", "2", "--num-workers", "0"]
    assert vit.main([*argv, "--output-dir", str(out)]) == 0
    results = json.loads((_only_run(out) / "results.json").read_text())
    assert (results["data"], results["optimizer_steps"]) == (str(root), 2)
    assert 0.0 <= results["val_acc"] <= 1.0


def test_only_lit_accel_argument_errors_become_one_line_errors(vit):
    # lit_accel documents ValueError/TypeError for bad settings: those are configuration errors, shown in one line.
    with pytest.raises(ValueError) as from_lit_accel:
        vit.AccelPrecision("int8-mixed")
    assert vit._is_lit_accel_config_error(from_lit_accel.value)
    # The same types raised anywhere else are bugs and keep their traceback.
    with pytest.raises(ValueError) as elsewhere:
        int("not a number")
    assert not vit._is_lit_accel_config_error(elsewhere.value)
    with pytest.raises(RuntimeError) as runtime:
        raise RuntimeError("a runtime failure is never a configuration error")
    assert not vit._is_lit_accel_config_error(runtime.value)
