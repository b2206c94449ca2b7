"""Smoke tests of AccelParallel's benchmarks (``parallel.py``, ``bubble.py``): they run as README says and write JSON.

Timing numbers are never asserted; what must hold on any machine is: both arms of ``parallel.py`` make the same FSDP
collectives per step and hold the same state per rank (same layout, same plan), and ``bubble.py``'s table has the
measured, analytic and textbook values for every cell.
"""

from __future__ import annotations

import pytest

from tests.benchmarks.test_benchmarks_smoke import _run


@pytest.mark.slow
def test_parallel_benchmark_compares_the_same_layout(tmp_path):
    result, _ = _run("parallel.py", tmp_path, "--tiny", timeout=600)
    results = result["results"]
    collectives = results["fsdp_collectives_per_step"]
    assert collectives["accel_parallel"] == collectives["model_parallel"] > 0
    memory = results["per_rank_state_mb"]
    assert memory["accel_parallel"] == memory["model_parallel"] > 0
    assert results["accel_parallel/model_parallel"]["median"] > 0


@pytest.mark.slow
def test_bubble_benchmark_writes_the_table(tmp_path):
    result, _ = _run("bubble.py", tmp_path, "--tiny", timeout=600)
    (cell,) = result["results"]
    assert (cell["schedule"], cell["pipeline"], cell["microbatches"]) == ("1f1b", 2, 4)
    assert 0 < cell["pipeline_bubble_frac"] < 1 and 0 < cell["pipeline_bubble_frac_analytic"] < 1
    assert cell["textbook"] == pytest.approx(1 / 5)
