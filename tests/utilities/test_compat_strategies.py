"""The private Lightning and torch attributes AccelDDP relies on, through ``lit_accel.utilities._compat``."""

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.utilities._compat import get_layer_sync, set_layer_sync
from tests.helpers import run_distributed


def test_layer_sync_accessors_read_what_the_trainer_assigned_and_replace_it():
    strategy = DDPStrategy()
    assert get_layer_sync(strategy) is None
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, sync_batchnorm=True, logger=False)
    assert isinstance(get_layer_sync(strategy), TorchSyncBatchNorm)  # the Trainer overwrote it after __init__
    ours = AccelSyncBatchNorm()
    set_layer_sync(strategy, ours)
    assert get_layer_sync(strategy) is ours
    set_layer_sync(strategy, None)
    assert get_layer_sync(strategy) is None


def test_ddp_strategy_still_applies_and_reverts_the_attribute_we_set():
    # If Lightning renamed `_layer_sync`, setting it would silently do nothing: fail here instead.
    assert "self._layer_sync.apply(self.model)" in inspect.getsource(DDPStrategy.setup)
    assert "self._layer_sync.revert(self.model)" in inspect.getsource(DDPStrategy.teardown)


# --- DDP's built-in logging: what AccelDDP's hookless comm_stats reads (real gloo ranks) ---


def _ddp_logging_semantics(rank: int, world_size: int) -> dict[str, Any]:
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.utilities._compat import ddp_logging_data, set_ddp_logging_sample_rate

    torch.manual_seed(0)
    # 104-byte buckets: one bucket at construction (DDP's first bucket may hold 1 MiB), several once rebuilt.
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), bucket_cap_mb=1e-4)
    construction = ddp_logging_data(ddp)
    set_ddp_logging_sample_rate(ddp, 3)
    seen = []  # after each synchronised iteration: (iteration of the latest published sample, layout, time)
    for step in range(14):
        if step == 5:
            with ddp.no_sync():  # not a synchronised iteration: DDP neither samples nor counts it
                ddp(torch.randn(2, 8)).sum().backward()
        ddp(torch.randn(2, 8)).sum().backward()
        data = ddp_logging_data(ddp)
        seen.append((data.get("iteration"), data.get("rebuilt_bucket_sizes"), data.get("backward_comm_time", 0)))
    hooked = DistributedDataParallel(nn.Linear(8, 4))
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    return {
        "construction": construction,
        "seen": seen,
        "numel": sum(p.numel() for p in ddp.parameters()),
        "hooked": ddp_logging_data(hooked).get("comm_hook"),
    }


def test_ddp_logging_data_and_sample_rate_mean_what_accel_ddp_assumes():
    """If torch renames these private DDP methods or changes what they report, AccelDDP's hookless stats are wrong."""
    results = run_distributed(_ddp_logging_semantics, 2, timeout=60)
    for result in results:
        construction, seen = result["construction"], result["seen"]
        # The construction layout: bytes per bucket, comma-separated; no hook registered, so no hook name.
        assert construction["bucket_sizes"] == str(4 * result["numel"])
        assert "comm_hook" not in construction and "rebuilt_bucket_sizes" not in construction
        assert result["hooked"] == "allreduce_hook"
        # Sampling: synchronised iterations 1-10, then every 3rd (12, 15, ...); iteration n is published at the
        # next synchronised forward, so after iteration i the latest published sample is the last sampled j < i.
        published = [iteration for iteration, _, _ in seen]
        assert published == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 12, 12]
        # The rebuilt layout appears with iteration 2's sample (the third synchronised forward), in bytes per bucket
        # that add up to the same gradients, split into more buckets.
        layouts = [layout for _, layout, _ in seen]
        assert layouts[:2] == [None, None] and len(set(layouts[2:])) == 1
        rebuilt = [int(size) for size in layouts[2].split(",")]
        assert sum(rebuilt) == 4 * result["numel"] and len(rebuilt) > 1
        # The per-round communication time (ns) of every published sample.
        assert seen[0][2] == 0 and all(time_ns > 0 for _, _, time_ns in seen[1:])
