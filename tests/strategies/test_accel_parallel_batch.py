"""AccelParallel's global-batch rule: exact short last batches and windows, one reduce-scatter per group per step.

Under a pipeline one optimizer step is one ``schedule.step()`` over the loaded batch; a short last batch of an epoch
runs with its own micro-batch count and is still the mean over its samples. Without a pipeline, Lightning's
accumulation with an exact partial last window. Either way FSDP reduce-scatters once per group per optimizer step,
counted by the strategy's comm stats.
"""

from __future__ import annotations

import pytest

from tests.strategies.test_accel_parallel import assert_equivalent


def _one_reduce_scatter_per_group_per_step(results, steps):
    for result in results:
        groups = result["fsdp_groups"]
        assert groups > 0
        assert result["comm"]["rounds"] == steps
        assert result["comm"]["reduce_scatters"] == groups * steps, (result["comm"], groups)


def test_pipeline_short_last_batch_and_one_reduce_scatter_per_group_per_step():
    # pp2 x dp2: 18 samples per replica in loaded batches of 12 -> steps over 12, 6 (split into 3, not 4, micro-batches:
    # the divisor of 6 nearest 4) and 12 samples; the reference steps on the joint batches of 24, 12, 24.
    results = assert_equivalent({"pipeline_parallel": 2, "microbatches": 4}, world=4, loaded=12, samples=36)
    _one_reduce_scatter_per_group_per_step(results, steps=3)


@pytest.mark.slow
def test_interleaved_short_last_batch():
    results = assert_equivalent(
        {"pipeline_parallel": 2, "schedule": "interleaved_1f1b", "microbatches": 4}, world=4, loaded=12, samples=36
    )
    _one_reduce_scatter_per_group_per_step(results, steps=3)


@pytest.mark.slow
def test_accumulation_partial_window_without_pipeline():
    # dp2 x tp2, global batch 16 = 4 loaded x 2 accumulation x 2 replicas; 20 samples per replica -> windows 2, 2, 1.
    results = assert_equivalent(
        {"tensor_parallel": 2, "global_batch_size": 16}, world=4, loaded=4, samples=40, reference_batch=16
    )
    _one_reduce_scatter_per_group_per_step(results, steps=3)
