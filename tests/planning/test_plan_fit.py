"""``lit_accel.plan``'s ``fits`` against real jobs whose address space is capped at the budget the plan was given.

Each job (``tests/scripts/plan_fit.py``: 2 processes, a GPT-style model of a few hundred MB per rank) caps each
rank's address space at its size before the model exists plus the budget, so the budget is what a device offers the
layout. A budget the plan says fits (its peak with the default 10% headroom) must train; one the plan's peak exceeds
by more than 10% must die for memory. One job at a time; about 15 s each (12 jobs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_accel import plan
from lit_accel.planning.plan import PlanRow
from tests.helpers.gpt import GPT
from tests.scripts import plan_fit

pytestmark = pytest.mark.slow

SCRIPT = Path(plan_fit.__file__)
ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "Cannot allocate memory")


def _planned(layout: str, budget: float | None = None) -> PlanRow:
    with torch.device("meta"):
        module = GPT(**plan_fit.SIZES)
    return plan(module, plan_fit.loaded_batch(), world_size=2, memory_per_device=budget, layouts=[layout])[layout]


def _run(layout: str, budget: float) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--layout", layout, "--budget-mb", f"{budget / 1e6:.3f}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, **ENV},
                          cwd=SCRIPT.parents[2], check=False)  # fmt: skip


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp+ac", "tp2", "pp2", "fsdp+offload"])
def test_a_budget_planned_to_fit_trains_and_one_short_by_more_than_10_percent_dies_for_memory(layout):
    peak = _planned(layout).peak_mb * 1e6
    enough, short = peak * 1.1, peak / 1.1 * 0.95  # the plan's fit with its headroom; its peak over 1.1 x budget

    fitting = _planned(layout, enough)
    assert fitting.fits is True and fitting.refused is None
    done = _run(layout, enough)
    assert done.returncode == 0 and "trained" in done.stdout, (layout, enough, done.stdout[-2000:], done.stderr[-3000:])

    refused = _planned(layout, short)
    assert refused.fits is False and "headroom" in refused.refused
    died = _run(layout, short)
    assert died.returncode != 0 and "trained" not in died.stdout, (layout, short, died.stdout[-2000:])
    assert any(sign in died.stderr for sign in OUT_OF_MEMORY), died.stderr[-3000:]
