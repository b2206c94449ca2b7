"""``examples/vit.py`` as users live with it: a folder per run, exact resume, training curves, a quiet console.

The runs go through ``vit.main`` in this process (the script's own code path, without the interpreter start-up of a
subprocess), except the console checks, which read what a user's terminal shows: the stderr of real processes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.examples._scripts import imported_example, unexpected_stderr_lines

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "vit.py"
# What every run folder holds when the run ends (fp32: no loss_scale.json).
RUN_FILES = {
    "config.yaml", "hparams.yaml", "metrics.csv", "results.json", "training.json", "training.png",
    "efficiency.json", "efficiency.png", "memory.json", "memory.png", "checkpoints/best.ckpt", "checkpoints/last.ckpt",
}  # fmt: skip


@pytest.fixture(scope="module")
def vit():
    with imported_example(SCRIPT, "vit_runs_example") as module:
        yield module


@pytest.fixture(autouse=True)
def _keep_threads_and_environment(monkeypatch):
    """vit.main sets the intra-op threads and leaves the run folder for its children: undo both after each test."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
    monkeypatch.delenv("LIT_ACCEL_EXAMPLE_RUN_DIR", raising=False)
    yield
    torch.set_num_threads(threads)


def _files(run: Path) -> set[str]:
    return {str(path.relative_to(run)) for path in run.rglob("*") if path.is_file()}


def _weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def _check_resume(vit, output: Path, first: int, total: int, extra: list[str]) -> tuple[Path, Path]:
    """Two consecutive runs (``first`` and ``total`` steps) keep two complete folders; the first, resumed to ``total``,
    ends with the weights, optimizer state and LR of the uninterrupted one. Returns (resumed, uninterrupted)."""
    common = ["--accelerator", "cpu", "--output", str(output), *extra]
    assert vit.main([*common, "--max-steps", str(first)]) == 0
    assert vit.main([*common, "--max-steps", str(total)]) == 0
    runs = sorted(path for path in output.iterdir() if path.is_dir())
    assert len(runs) == 2, runs  # the second run made a folder of its own
    interrupted, uninterrupted = runs
    for run, steps in ((interrupted, first), (uninterrupted, total)):
        assert _files(run) >= RUN_FILES, sorted(RUN_FILES - _files(run))
        assert json.loads((run / "results.json").read_text())["optimizer_steps"] == steps
    first_weights = _weights(interrupted)["state_dict"]

    assert vit.main([*common, "--max-steps", str(total), "--resume", str(interrupted)]) == 0
    assert sorted(path for path in output.iterdir() if path.is_dir()) == runs  # continued in its own folder
    resumed, reference = _weights(interrupted), _weights(uninterrupted)
    assert resumed["global_step"] == reference["global_step"] == total
    assert not all(torch.equal(first_weights[k], resumed["state_dict"][k]) for k in first_weights)  # it trained on
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    states = zip(resumed["optimizer_states"][0]["state"].values(), reference["optimizer_states"][0]["state"].values())
    for mine, theirs in states:
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert resumed["lr_schedulers"] == reference["lr_schedulers"]
    # the precision plugin's state: the fp16 loss scale and its growth tracker and skip counters; in fp32 (Lightning's
    # plugin, no state) the NonFiniteGuard's counters
    if "AccelPrecision" in reference:
        assert resumed["AccelPrecision"] == reference["AccelPrecision"]
    else:
        guard = next(key for key in reference["callbacks"] if key.startswith("NonFiniteGuard"))
        assert resumed["callbacks"][guard] == reference["callbacks"][guard]
    # the curves continue the interrupted run's: its history came back from the checkpoint
    history = json.loads((interrupted / "training.json").read_text())
    assert history["steps"] == json.loads((uninterrupted / "training.json").read_text())["steps"]
    # the resumed part logged beside the first, which it did not replace
    assert (interrupted / "metrics.csv").is_file() and (interrupted / "resumed-1" / "metrics.csv").is_file()
    return interrupted, uninterrupted


def test_runs_keep_their_folders_resume_exactly_and_draw_their_curves(vit, tmp_path):
    # Lean: 5 then 10 steps of the tiny digits ViT at 8 px (the efficiency report needs steps past its 3 of warm-up),
    # resumed mid-epoch; both runs named alike, so the second is numbered.
    extra = ["--img-size", "8", "--log-interval", "2", "--experiment", "same", "--warmup-epochs", "0.5"]
    resumed, uninterrupted = _check_resume(vit, tmp_path, 5, 10, extra)
    assert (resumed.name, uninterrupted.name) == ("same", "same-1")
    # --resume last: the run under --output that saved last (the resumed one); its settings from its config.yaml,
    # not this invocation's budget
    last = vit.parse_args(["--output", str(tmp_path), "--resume", "last", "--max-steps", "12"])
    assert last.run_dir == str(resumed) and last.resume == str(resumed / "checkpoints" / "last.ckpt")
    assert (last.img_size, last.max_steps, last.warmup_epochs) == (8, 12, 0.5)

    # The training curves, from the run's own metrics.
    history = json.loads((uninterrupted / "training.json").read_text())
    assert [row["step"] for row in history["steps"]] == [2, 4, 6, 8, 10]
    assert all(row["train_loss"] > 0 and row["lr"] > 0 for row in history["steps"])
    (validation,) = history["validations"]  # the stop validated the final weights, inside fit
    results = json.loads((uninterrupted / "results.json").read_text())
    assert validation["step"] == 10 and validation["val_acc"] == pytest.approx(results["val_acc"])
    with open(uninterrupted / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [float(r["val/acc"]) for r in rows if r.get("val/acc")] == pytest.approx([validation["val_acc"]])
    assert [float(r["train/loss"]) for r in rows if r.get("train/loss")] == pytest.approx(
        [row["train_loss"] for row in history["steps"]]
    )
    # timm's --warmup-epochs in this run's steps: 1,437 training digits in batches of 32 are 44 steps per epoch
    assert results["warmup_steps"] == 22
    # the picture shows those series: loss, accuracy and LR over the optimizer steps
    loss, accuracy, lr = _training_figure()(history, "run").axes[:3]
    lines = {line.get_label(): line for axes in (loss, accuracy, lr) for line in axes.get_lines()}
    assert list(lines["training loss"].get_xdata()) == [2, 4, 6, 8, 10]
    assert list(lines["validation top-1"].get_ydata()) == pytest.approx([100 * validation["val_acc"]])
    assert list(lines["learning rate"].get_ydata()) == pytest.approx([row["lr"] for row in history["steps"]])


def _training_figure():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from _vit_report import training_figure
    finally:
        sys.path.remove(str(REPO / "examples"))
    return training_figure


@pytest.mark.slow
def test_an_fp16_run_resumes_with_its_loss_scale(vit, tmp_path):
    # CPU fp16 is emulated (slow): the loss scale's growth tracker and scale continue from the checkpoint.
    _check_resume(vit, tmp_path, 5, 10, ["--img-size", "8", "--precision", "16-mixed", "--log-interval", "5"])


@pytest.mark.slow
def test_two_runs_of_30_steps_and_a_resume_to_60_match_an_uninterrupted_run(vit, tmp_path):
    # The acceptance as written: --max-steps 30 twice, then the first resumed across the epoch boundary
    # (44 steps per epoch of 32 digits) to 60, against an uninterrupted 60-step run.
    _check_resume(vit, tmp_path, 30, 60, [])


def test_resume_without_a_checkpoint_is_a_one_line_error(vit, tmp_path, capsys):
    assert vit.main(["--accelerator", "cpu", "--output", str(tmp_path), "--resume", "last"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --resume last: no run under --output")


def test_plan_prints_every_layouts_memory_and_starts_no_run(vit, tmp_path, capsys):
    # issue #50: the run it would start, planned (4 processes' layouts), and nothing trained or written
    argv = ["--accelerator", "cpu", "--devices", "4", "--batch-size", "8", "--global-batch-size", "64"]
    assert vit.main([*argv, "--output", str(tmp_path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "lit_accel.plan: 4 processes, 32-true" in out
    # each layout's accumulation for the 64 images a step: 4, 4, 2 and 1 data ranks loading 8
    for layout, accumulate in (("ddp", 2), ("fsdp", 2), ("dp2xtp2", 4), ("tp4", 8)):
        assert re.search(rf"│ {layout} +│ +[\d.]+ [kM]B.*│ +{accumulate} │ fits", out), (
            layout,
            out,
        )  # the host's RAM / 4
    assert "ImageClassifier.pipeline_loss(output, target)" in out  # a pipeline is refused as the strategy would
    assert list(tmp_path.iterdir()) == []


def test_timms_flag_names_and_the_earlier_ones_set_the_same_settings(vit, tmp_path):
    timm_style = ["-b", "8", "--grad-accum-steps", "2", "-j", "1", "--torchcompile", "--output", "out",
                  "--log-interval", "5", "--data-dir", "digits"]  # fmt: skip
    earlier = ["--batch-size", "8", "--accumulate", "2", "--num-workers", "1", "--compile", "--output-dir", "out",
               "--log-every-n-steps", "5", "--data", "digits"]  # fmt: skip
    timm_style, earlier = (vit.parse_args(["--accelerator", "cpu", *argv]) for argv in (timm_style, earlier))
    assert vars(timm_style) == vars(earlier)
    assert (timm_style.batch_size, timm_style.accumulate, timm_style.num_workers) == (8, 2, 1)
    assert (timm_style.compile, timm_style.output, timm_style.log_every_n_steps) == (True, "out", 5)
    # a config file may use either name
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"grad_accum_steps": 2, "workers": 1, "output_dir": "out"}))
    from_file = vit.parse_args(["--accelerator", "cpu", "--config", str(config), "-b", "8"])
    assert (from_file.accumulate, from_file.num_workers, from_file.output) == (2, 1, "out")


# ----------------------------------------------------------------------------------------------------------------------
# The console (real processes)
# ----------------------------------------------------------------------------------------------------------------------
def _script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    for key in ("OMP_NUM_THREADS", "LIT_ACCEL_EXAMPLE_RUN_DIR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# Two processes take ~2x one; the default suite checks a two-process run's stderr the same way in
# test_vit_example.py::test_cli_two_cpu_processes_train_and_print_the_final_table (synthetic data, accumulation 4).
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_default_runs_print_no_warning_of_ours_and_a_line_per_epoch(tmp_path, devices):
    proc = _script(["--accelerator", "cpu", "--devices", str(devices), "--max-steps", "6", "--output", str(tmp_path)],
                   timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    # issue #51: the default run prints what the user asked for, no note of ours (upstream's lines are listed)
    assert unexpected_stderr_lines(proc.stderr, notes=False) == [], proc.stderr[-4000:]
    epoch_lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/30 | step 6 | train loss")]
    assert len(epoch_lines) == 1, proc.stdout[-3000:]  # rank 0 only
    assert "val top-1" in epoch_lines[0] and "samples/s" in epoch_lines[0]
    table = proc.stdout[proc.stdout.index("ViT case study: results") :]
    assert re.search(r"│ MFU +│ +no MFU on CPU │", table), table
    # nor on stdout: the example's own header, Lightning's summary and progress bar, the epoch lines, the table
    ours = re.compile(r"^\s*(Accel\w+|\w+Monitor|\w+Meter|HangWatchdog|NonFiniteGuard|note)\b.*: ")
    assert [line for line in proc.stdout.splitlines() if ours.match(line)] == [], proc.stdout[-3000:]
    (run,) = list(tmp_path.iterdir())
    assert (run / "training.png").stat().st_size > 0
