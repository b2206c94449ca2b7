"""``examples/fabric_loop.py``: a real 2-process Fabric DDP run (Fabric starts rank 1 itself) with fp16 loss scaling.

The script is run with README.md's command, an overflow injected on rank 1; its ``metrics``/``summary`` lines must hold
exactly what torch's loss-scaling rule and the run's shape imply: the scale's path through growths and the one
back-off, the skipped step counted on every rank (the weights stay identical), global samples per step, the FLOPs of
the MLP, and no comm figures (Fabric's DDP does not count its all-reduces).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "fabric_loop.py"
# README.md, "With Fabric", runs exactly this; the expectations below follow from its arguments and the defaults.
COMMAND = (
    "python examples/fabric_loop.py --accelerator cpu --devices 2 --init-scale 1024 --growth-interval 8 "
    "--overflow-at-step 5"
)


def _arguments():
    spec = importlib.util.spec_from_file_location("fabric_loop_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser().parse_args(shlex.split(COMMAND)[2:])


ARGS = _arguments()
RANKS, (OVERFLOW_AT,) = ARGS.devices, ARGS.overflow_at_step


def _scale_path(steps: int) -> list[dict[str, float]]:
    """torch's dynamic loss scaling (hysteresis 1): the scaler's state after each optimizer step."""
    scale, tracker, skipped, growths, backoffs, states = ARGS.init_scale, 0, 0, 0, 0, []
    for step in range(steps):
        if step + 1 == OVERFLOW_AT:  # the script counts steps from 1, as it prints them
            scale, tracker, skipped, backoffs = scale / 2, 0, skipped + 1, backoffs + 1
        else:
            tracker += 1
            if tracker == ARGS.growth_interval:
                scale, tracker, growths = scale * 2, 0, growths + 1
        states.append({"loss_scale": scale, "skipped_steps": skipped, "scale_growths": growths,
                       "scale_backoffs": backoffs})  # fmt: skip
    return states


def test_the_readme_shows_this_command():
    assert COMMAND in (REPO / "README.md").read_text()


@pytest.fixture(scope="module")
def run() -> tuple[list[dict], dict, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)  # let Fabric pick a free port
    command = [sys.executable, *shlex.split(COMMAND)[1:], "--json"]  # the readable lines, and the figures as JSON
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    windows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("metrics ")]
    summaries = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("summary ")]
    assert len(summaries) == 1, output[-5000:]  # rank 0 prints; rank 1 does not
    return windows, summaries[0], proc.stdout


def test_loss_scale_figures_follow_the_scalers_rule_with_the_injected_overflow(run):
    windows, summary, _ = run
    steps, every = ARGS.steps, ARGS.log_every
    path = _scale_path(steps)
    assert path[-1]["scale_growths"] > 0 and path[-1]["scale_backoffs"] == 1  # the run shows both directions
    assert [w["step"] for w in windows] == list(range(every, steps + 1, every))
    for window in windows:
        step = window["step"]
        for key, value in path[step - 1].items():
            assert window[f"amp/{key}"] == value, (step, key)
        assert math.log2(window["amp/loss_scale"]).is_integer()
        before = path[step - every - 1]["skipped_steps"] if step > every else 0
        assert window["amp/skip_rate"] == pytest.approx((path[step - 1]["skipped_steps"] - before) / every)
    assert summary["amp/skipped_steps"] == 1 and summary["amp/steps"] == steps
    assert summary["amp/loss_scale"] == path[-1]["loss_scale"]
    assert summary["amp/min_scale"] == min(state["loss_scale"] for state in path)
    # rank 1's overflow reached rank 0 through the all-reduce: both skipped it, so the weights are still identical
    first, *others = summary["param_checksums"]
    assert len(others) == RANKS - 1 and all(checksum == first for checksum in others)


def test_each_logging_step_prints_a_readable_line_naming_the_skipped_step(run):
    windows, _, stdout = run
    lines = [line for line in stdout.splitlines() if re.match(r"step +\d+/\d+ \| loss ", line)]
    assert [int(re.match(r"step +(\d+)", line).group(1)) for line in lines] == [w["step"] for w in windows]
    skipped = [line for line in lines if "skipped" in line]
    # the injected overflow's step, by number, in the window that holds it, and in no other
    assert len(skipped) == 1 and f"skipped step {OVERFLOW_AT} (inf/NaN gradients" in skipped[0]
    assert lines.index(skipped[0]) == (OVERFLOW_AT - 1) // ARGS.log_every
    first = lines[0]
    assert "samples/s" in first and "step time" in first and "loss scale 512" in first
    assert "{" not in first  # not a dict of 16-digit floats


def test_efficiency_figures_count_both_ranks_and_the_mlps_flops(run):
    windows, summary, stdout = run
    hidden, global_batch = ARGS.hidden, ARGS.batch_size * RANKS
    # 64 -> h -> h -> 10: forward 2*(64h + h^2 + 10h) per sample; backward twice that, less the input's gradient
    forward = 2 * (64 * hidden + hidden * hidden + 10 * hidden)
    assert summary["flops_per_sample"] == 2 * forward + 2 * (hidden * hidden + 10 * hidden)
    assert summary["perf/measured_steps"] == ARGS.steps - ARGS.warmup_steps
    for figures in [*windows, summary]:
        assert figures["perf/samples_per_sec"] > 0
        # samples/s x step time = samples per optimizer step, over both ranks
        samples_per_step = figures["perf/samples_per_sec"] * figures["perf/step_time_ms"] / 1e3
        assert samples_per_step == pytest.approx(global_batch)
        assert figures["perf/samples_per_sec_per_device"] == pytest.approx(figures["perf/samples_per_sec"] / RANKS)
        tflops = figures["perf/tflops_per_device"] * 1e12
        assert tflops == pytest.approx(summary["flops_per_sample"] * figures["perf/samples_per_sec_per_device"])
        assert 0.0 <= figures["perf/data_wait_frac"] < 1.0 and figures["perf/step_time_spread"] >= 1.0
        assert not any(key.startswith("perf/comm_") for key in figures)  # Fabric's DDP exposes no comm stats
        assert "perf/mfu" not in figures  # no peak given for a CPU
    assert "samples/s (global)" in stdout  # the EfficiencyMonitor's table
    assert "not measured: Fabric's DDPStrategy counts no" in stdout  # the table says why it has no comm rows
