"""AccelDDP's counting without a comm hook (``BucketRounds``) against a hook that sees every bucket, on real gloo ranks.

The Lightning runs (automatic and manual optimization, two fits, a layout that changes) are in test_accel_ddp.py; here
raw DDP checks the layout rule on the settings that move DDP's bucket rebuild: none, ``static_graph`` (rebuilt one
round later) and ``find_unused_parameters`` (never rebuilt, another construction layout).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lit_accel.strategies.ddp._bucket_rounds import BucketRounds
from lit_accel.strategies.parts._comm_stats import HookCommStats
from tests.helpers import run_distributed

_SETTINGS = {"default": {}, "static_graph": {"static_graph": True}, "find_unused": {"find_unused_parameters": True}}
_ROUNDS = 5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))


def _counts(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for name, kwargs in _SETTINGS.items():
        seen: list[tuple[int, int]] = []  # (calls, bytes) after each round, from a hook that sees every bucket

        def hook(state, bucket, seen=seen):  # no annotations: DDP compares them with its own types
            buffer = bucket.buffer()
            calls, nbytes = seen[-1] if seen else (0, 0)
            seen[-1:] = [(calls + 1, nbytes + buffer.numel() * buffer.element_size())]
            return default_hooks.allreduce_hook(None, bucket)

        hooked = DistributedDataParallel(_net(), bucket_cap_mb=1e-4, **kwargs)  # 104-byte buckets
        hooked.register_comm_hook(None, hook)
        plain = DistributedDataParallel(_net(), bucket_cap_mb=1e-4, **kwargs)
        stats = HookCommStats()
        stats.bucket_rounds = BucketRounds(plain)
        reads = []
        for step in range(_ROUNDS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
            seen.append(seen[-1] if seen else (0, 0))
            hooked(x).sum().backward()
            if not kwargs.get("static_graph"):  # (DDP's static graph refuses no_sync)
                with plain.no_sync():  # not a round: nothing reduced, nothing counted
                    plain(x).sum().backward()
                if plain.require_forward_param_sync:
                    stats.count_round()
            plain(x).sum().backward()
            if plain.require_forward_param_sync:  # as AccelDDP.backward does
                stats.count_round()
            reads.append((stats.calls, stats.bytes))
        out[name] = {"hooked": seen, "plain": reads, "rounds": stats.rounds}
    return out


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_distributed(_counts, 2, timeout=120)


@pytest.mark.parametrize("setting", list(_SETTINGS))
def test_rounds_and_layout_count_what_a_hook_sees(counts, setting):
    for rank_counts in counts:
        run = rank_counts[setting]
        assert run["plain"] == run["hooked"] and run["rounds"] == _ROUNDS
    per_round = [b[0] - a[0] for a, b in zip([(0, 0), *counts[0][setting]["hooked"]], counts[0][setting]["hooked"])]
    if setting == "find_unused":
        assert len(set(per_round)) == 1  # never rebuilt
    else:  # rebuilt before round 2, or round 3 under static_graph: the layout really changes
        first_rebuilt = 2 if setting == "static_graph" else 1
        assert per_round[first_rebuilt] != per_round[0] and len(set(per_round[first_rebuilt:])) == 1


def _sampled_pops(rank: int, world_size: int) -> list[dict[str, Any]]:
    from lit_accel.utilities._compat import ddp_sampled_round, set_ddp_sample_rate

    ddp = DistributedDataParallel(_net(), bucket_cap_mb=1e-4)
    set_ddp_sample_rate(ddp, 3)
    stats = HookCommStats()
    stats.bucket_rounds = BucketRounds(ddp)
    reads = []
    for rounds in (1, 4, 0, 2, 5):  # rounds between pops (the first pop comes before DDP published any sample)
        for _ in range(rounds):
            with ddp.no_sync():  # not a round
                ddp(torch.randn(4, 8)).sum().backward()
            ddp(torch.randn(4, 8)).sum().backward()
            if ddp.require_forward_param_sync:  # as AccelDDP.backward does
                stats.count_round()
        sample = ddp_sampled_round(ddp)  # the latest sampled round, read as the pops will
        reads.append({"rounds": rounds, "sample": sample, "pops": (stats.pop_elapsed_s(), stats.pop_exposed_s())})
    stats.release_rounds()  # the fit ends: the model is dropped, nothing more to estimate
    ddp(torch.randn(4, 8)).sum().backward()
    reads.append({"after_release": (stats.pop_elapsed_s(), stats.pop_exposed_s())})
    return reads


def test_hookless_pops_are_the_rounds_since_the_last_pop_times_ddps_latest_sampled_round():
    for reads in run_distributed(_sampled_pops, 2, timeout=60):
        first, *timed, released = reads
        assert first["sample"] is None and first["pops"] == (0.0, 0.0)  # iteration 1 publishes at the next forward
        for read in timed:
            _, comm_s, overlap_s = read["sample"]
            assert comm_s > 0.0
            elapsed, exposed = read["pops"]
            assert elapsed == read["rounds"] * comm_s
            assert exposed == read["rounds"] * max(0.0, comm_s - overlap_s)
        # After k rounds DDP has published round k - 1 (at round k's forward): every round up to 10, then every 3rd.
        assert [read["sample"][0] for read in timed] == [4, 4, 6, 10]  # (rounds 5, 5, 7, 12)
        assert released["after_release"] == (0.0, 0.0)
