"""``micro_batch_size="auto"`` under a real memory cap: 2 gloo processes whose address space is capped (RLIMIT_AS).

Each run is ``tests/scripts/micro_batch_oom.py`` in a subprocess. AccelDDP searches by attempts (no collective in
them), AccelFSDP by attempts with every parameter gathered (or trials with collectives that it never interrupts). The
caps are set from footprints measured here, on the machine the tests run on (uncapped runs with a fixed micro-batch:
the address space each added at its largest), halfway between a size's footprint and the next larger one's. The size
chosen must then be at least half that size and below the next, train under the cap with the weights of the fixed
run (fp32, 1e-5), and the next larger size must not fit; a sweep of caps from "everything fits" to "no sample fits"
must never hang and never die at a size it chose.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "micro_batch_oom.py"
MESSAGES = (
    "out of memory in a micro-batch of",
    "sample(s) does not fit in memory",
    "no micro-batch fits with",
    "then a larger attempt ran out of memory",
    "can't allocate memory",
)
UNCAPPED = 1e6  # MB


def _run_capped(tmp: Path, budget_mb: float, micro: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"{micro}-{budget_mb}{''.join(extra)}.pt"
    # One malloc arena (its 64 MB reservations would eat the cap) and every large block mmapped (freed ones return
    # their address space), so the cap measures the tensors.
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--budget-mb", str(budget_mb), "--micro", micro, "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True), out


def _capped(tmp: Path, budget_mb: float, micro: str, *extra: str) -> dict[str, Any]:
    done, out = _run_capped(tmp, budget_mb, micro, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _fits(tmp: Path, budget_mb: float, micro: int, *extra: str) -> bool:
    return _run_capped(tmp, budget_mb, str(micro), *extra)[0].returncode == 0


@functools.cache
def _footprint_mb(tmp: Path, micro: int, *extra: str) -> float:
    """The address space (MB) an uncapped fit with a fixed micro-batch added at its largest, on either rank."""
    return _capped(tmp, UNCAPPED, str(micro), *extra)["footprint"] / 1e6


@functools.cache
def _joint(tmp: Path, *extra: str) -> dict[str, torch.Tensor]:
    """One process, no cap, the joint batch of both ranks: the weights every run must end with."""
    return _capped(tmp, UNCAPPED, "auto", "--reference", *extra)["state"]


def _close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        assert torch.allclose(value, expected[key], atol=1e-5), key


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("capped")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "model", "size"),
    # (model "issue": issue #47's Linear(8, 65536), four elementwise layers, Linear(65536, 4), 64 loaded per device)
    [("ddp", "wide", 16), ("fsdp", "wide", 16), ("fsdp", "wide", 8), ("ddp", "issue", 32), ("fsdp", "issue", 32)],
)
def test_auto_chooses_the_largest_micro_batch_that_fits_or_the_next_smaller(tmp_module, strategy, model, size):
    args = ("--strategy", strategy, "--model", model)
    fits, next_fits = _footprint_mb(tmp_module, size, *args), _footprint_mb(tmp_module, 2 * size, *args)
    assert fits < next_fits, (fits, next_fits)  # memory grows with the micro-batch, or the case tests nothing
    budget_mb = round((fits + next_fits) / 2, 1)
    auto = _capped(tmp_module, budget_mb, "auto", *args)
    assert size // 2 <= auto["micro"] < 2 * size, f"chose {auto['micro']} under {budget_mb} MB ({fits} MB fit {size})"
    fixed = _capped(tmp_module, budget_mb, str(auto["micro"]), *args)  # the choice trains under the same cap
    assert not _fits(tmp_module, budget_mb, 2 * size, *args), f"{2 * size} fits in {budget_mb} MB"
    _close(auto["state"], fixed["state"])
    _close(auto["state"], _joint(tmp_module, "--model", model))


@pytest.mark.slow
@pytest.mark.parametrize("run", range(5))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_issue_47s_case_trains_with_the_weights_of_the_size_it_chose(tmp_module, strategy, run):
    """Five runs each: the cap halfway between the footprints of 32 and 64 samples (64 loaded per device)."""
    args = ("--strategy", strategy, "--model", "issue")
    budget_mb = round((_footprint_mb(tmp_module, 32, *args) + _footprint_mb(tmp_module, 64, *args)) / 2, 1)
    auto = _capped(tmp_module, budget_mb, "auto", *args)
    _close(auto["state"], _capped(tmp_module, UNCAPPED, str(auto["micro"]), *args)["state"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("budget_mb", [1e6, 30, 26, 22, 14, 6])
def test_auto_under_a_sweep_of_caps_never_hangs(tmp_module, strategy, budget_mb):
    """From a cap nothing reaches to one where no sample fits: finished with the joint batch's weights, or stopped
    on every rank with a message (ours, or the allocator's where the cap hits outside the training step), never at a
    size the search chose."""
    done, out = _run_capped(tmp_module, budget_mb, "auto", "--strategy", strategy)
    assert "HangWatchdog" not in done.stderr, done.stderr[-3000:]
    if done.returncode == 0:
        _close(torch.load(out, weights_only=True)["state"], _joint(tmp_module, "--model", "wide"))
        return
    assert any(message in done.stderr for message in MESSAGES), done.stderr[-3000:]
    assert done.stderr.count("[rank0]") and done.stderr.count("[rank1]"), "both ranks must report"
    chose = re.search(r"micro_batch_size='auto' chose (\d+)", done.stderr + done.stdout)
    assert chose is None or f"micro-batch of {chose.group(1)} samples." not in done.stderr, done.stderr[-3000:]
