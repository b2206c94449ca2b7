"""The fallbacks of torch APIs newer than the floor: both branches on real gloo groups, and the gates' versions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from packaging.version import Version

from lit_accel.utilities import _torch_fallbacks as fb
from tests.helpers import run_distributed

_TORCH = Version(torch.__version__.split("+")[0])


def test_the_gate_opens_at_the_release_named_beside_it():
    # If this fails, torch moved the API: update the version in _torch_fallbacks.py (or delete the fallback).
    released_in = Version("2.13")
    assert fb.HAS_SINGLE_COLLECTIVES is (released_in <= _TORCH)


def _collectives(rank: int, world_size: int) -> dict[str, list[float]]:
    branches = [False, True] if fb.HAS_SINGLE_COLLECTIVES else [False]
    out: dict[str, list[float]] = {}
    for native in branches:
        local = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        gathered = torch.empty(world_size * 2)
        fb.all_gather_single(gathered, local, native=native)
        gathered_async = torch.empty(world_size * 2)
        fb.all_gather_single(gathered_async, local, group=dist.group.WORLD, async_op=True, native=native).wait()
        full = torch.arange(world_size * 3, dtype=torch.float32) * (rank + 1)
        summed = torch.empty(3)
        fb.reduce_scatter_single(summed, full, native=native)
        largest = torch.empty(3)
        work = fb.reduce_scatter_single(largest, full, op=dist.ReduceOp.MAX, async_op=True, native=native)
        work.wait()
        key = "native" if native else "fallback"
        out[key] = [*gathered.tolist(), *gathered_async.tolist(), *summed.tolist(), *largest.tolist()]
    return out


def test_both_branches_gather_and_reduce_scatter_alike_on_gloo():
    results = run_distributed(_collectives, 2, timeout=120)
    for rank, result in enumerate(results):
        # all-gather: rank order; reduce-scatter: rank r keeps chunk r of the sum (x3 = 1 + 2) and of the max (x2).
        chunk = [3.0 * rank, 3.0 * rank + 1, 3.0 * rank + 2]
        expected = [1.0, 10.0, 2.0, 20.0] * 2 + [3 * v for v in chunk] + [2 * v for v in chunk]
        assert result["fallback"] == expected
        if fb.HAS_SINGLE_COLLECTIVES:
            assert result["native"] == expected
