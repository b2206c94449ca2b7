"""The private Lightning and torch attributes AccelDDP relies on, through ``lit_accel.utilities._compat``."""

import inspect

import lightning.pytorch as pl
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


# --- DDP's logging data: read by tests and benchmarks only (real gloo ranks) ---


def _ddp_logging_hook_name(rank: int, world_size: int) -> tuple[object, bool]:
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.utilities._compat import ddp_logging_data

    hooked = DistributedDataParallel(nn.Linear(8, 4))
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    plain = DistributedDataParallel(nn.Linear(8, 4))
    return ddp_logging_data(hooked).get("comm_hook"), "comm_hook" in ddp_logging_data(plain)


def test_ddp_logging_data_names_the_registered_comm_hook():
    """The tests prove AccelDDP registered its hook through DDP's own record of it."""
    for name, plain_has_one in run_distributed(_ddp_logging_hook_name, 2, timeout=60):
        assert name == "allreduce_hook" and not plain_has_one


def _bucket_sizes(rank: int, world_size: int) -> dict[str, object]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.utilities._compat import ddp_bucket_sizes

    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), bucket_cap_mb=1e-4)
    out: dict[str, object] = {"built": ddp_bucket_sizes(ddp, rebuilt=False)}
    for step in range(3):
        ddp(torch.randn(4, 8)).sum().backward()  # DDP rebuilds its buckets in the second forward
        if step == 1:  # rebuilt, not yet published in DDP's logging data: read from the reducer
            out["from_reducer"] = ddp_bucket_sizes(ddp, rebuilt=True)
    out["published"] = ddp_bucket_sizes(ddp, rebuilt=True)  # published at the third forward
    return out


def test_ddp_bucket_sizes_of_the_built_and_the_rebuilt_layout():
    """AccelDDP's counting without a hook reads DDP's layouts (bytes per bucket) through these two routes."""
    for sizes in run_distributed(_bucket_sizes, 2, timeout=60):
        grads = 4 * (8 * 8 + 8 + 8 * 4 + 4)
        assert sizes["built"] == (grads,)  # the first bucket holds up to 1 MiB
        assert sizes["from_reducer"] == sizes["published"] and len(sizes["published"]) > 1
        assert sum(sizes["published"]) == grads


def _sampled_rounds(rank: int, world_size: int) -> dict[str, object]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lit_accel.utilities._compat import ddp_logging_data, ddp_sampled_round, set_ddp_sample_rate

    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), bucket_cap_mb=1e-4)
    set_ddp_sample_rate(ddp, 4)
    iterations, samples, raw = [], [], []
    for _ in range(14):
        ddp(torch.randn(4, 8)).sum().backward()
        with ddp.no_sync():  # not a synchronised iteration: DDP neither counts nor times it
            ddp(torch.randn(4, 8)).sum().backward()
        sample = ddp_sampled_round(ddp)
        iterations.append(None if sample is None else sample[0])
        samples.append(sample)
        data = ddp_logging_data(ddp)
        raw.append(None if sample is None else (data["backward_comm_time_end"], data["backward_compute_time_end"]))
    return {"iterations": iterations, "samples": samples, "raw": raw}


def test_ddp_samples_rounds_at_the_rate_set_and_their_exposed_part_is_comm_end_minus_compute_end():
    """AccelDDP's hookless timing reads DDP's sampled rounds: the rate it sets is the one DDP samples at."""
    for out in run_distributed(_sampled_rounds, 2, timeout=60):
        # Iteration n is published at the next synchronised forward: after the first backward, nothing yet; every
        # iteration up to 10 is sampled, then every 4th (torch's default would keep 10 until the 100th).
        assert out["iterations"] == [None, *range(1, 11), 10, 12, 12]
        for sample, raw in zip(out["samples"][1:], out["raw"][1:]):
            _, comm_s, overlap_s = sample
            assert 0.0 <= overlap_s <= comm_s
            # comm - overlap (two durations, also right on CUDA) = the end of the comm - the end of the compute (CPU)
            comm_end, compute_end = raw
            assert round((comm_s - overlap_s) * 1e9) == comm_end - compute_end
