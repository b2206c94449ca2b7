"""Micro-batching: loaded batches split into micro-batches, fixed or ``"auto"`` (the largest that fits in memory).

The training must not change: a split run equals one process on the joint batch (fp32, 1e-5), an out-of-memory
recovery equals a run with the smaller micro-batch from the start, on real gloo processes with real allocation
failures (a capped address space, and a huge allocation on one rank).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision, DynamicGradScaler
from lit_accel.strategies._micro_batches import MicroBatching, is_out_of_memory, split_batch
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs
from tests.strategies.test_accel_fsdp import full_state

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "micro_batch_oom.py"


def test_split_batch_slices_every_tensor_of_nested_batches():
    batch = {"x": torch.arange(6), "pair": (torch.ones(6, 2), [torch.zeros(6)]), "name": "keep"}
    part = split_batch(batch, 2, 5)
    assert part["x"].tolist() == [2, 3, 4] and part["pair"][0].shape == (3, 2) and part["pair"][1][0].shape == (3,)
    assert part["name"] == "keep"
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert is_out_of_memory(MemoryError("std::bad_alloc")) and is_out_of_memory(torch.OutOfMemoryError("CUDA"))


def test_out_of_memory_averaging_gradients_is_named_not_retried():
    class Strategy:  # AccelDDP's averaging, failing to allocate its flat bucket
        def _average_gradients(self) -> None:
            torch.empty(2**40, dtype=torch.uint8)

    with pytest.raises(RuntimeError, match=r"out of memory averaging the gradients .* which no micro-batch size"):
        MicroBatching("AccelDDP", "auto")._average(Strategy())


def _fit(rank: int, world: int, strategy: Any, loader_batch: int, steps: int = 4, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = kwargs.pop("model", lambda: BNModel(batchnorm=False))()  # a factory: built after the seed
    trainer_kwargs = small_trainer_kwargs(devices=world, max_steps=steps, max_epochs=-1, use_distributed_sampler=False)
    trainer_kwargs.update(kwargs)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs)
    sampler = (rank, world) if world > 1 else (None, None)
    trainer.fit(model, make_loader(make_dataset(72), loader_batch, *sampler))
    return {
        "state": full_state(model),
        "micro": strategy.micro_batch_size,
        "changes": [(c.step, c.old, c.new) for c in strategy.micro_batch_changes],
        "accumulation": trainer.accumulate_grad_batches,
        "rounds": getattr(strategy.comm_stats, "rounds", None),  # FSDP: reduce-scatter rounds
        "recoveries": list(getattr(getattr(strategy, "_ledger", None), "recoveries", [])),
    }


def _reference(global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=False)
    pl.Trainer(**small_trainer_kwargs(max_steps=steps, max_epochs=-1)).fit(
        model, make_loader(make_dataset(72), global_batch)
    )
    return params_of(model)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max().item())


def _fixed_runs(rank: int, world: int) -> dict[str, Any]:
    return {
        # 12 per loaded batch and device, split into micro-batches of 5 (5, 5, 2): one optimizer step per loaded batch
        "ddp": _fit(rank, world, AccelDDP(global_batch_size=24, micro_batch_size=5), 12),
        # the same split under FSDP, plus Lightning's accumulation of 2 loaded batches of 6 (split 4, 2)
        "fsdp": _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size=4), 6),
    }


def test_a_fixed_micro_batch_splits_loaded_batches_without_changing_the_training():
    reference = _reference(24, 4)  # 72 = 3 steps of 24 per epoch: 4 steps run into the second epoch
    for runs in run_distributed(_fixed_runs, 2, init_process_group=False, timeout=180):
        assert (runs["ddp"]["micro"], runs["ddp"]["accumulation"]) == (5, 1)
        assert (runs["fsdp"]["micro"], runs["fsdp"]["accumulation"]) == (4, 2)
        assert runs["fsdp"]["rounds"] == 4  # one reduce-scatter round per optimizer step: none inside the window
        _close(runs["ddp"]["state"], reference)
        _close(runs["fsdp"]["state"], reference)


class _OOMOnce(BNModel):
    """Rank 1 fails a real allocation (a terabyte) in its first micro-batch of optimizer step 2, once."""

    def __init__(self) -> None:
        super().__init__(batchnorm=False)
        self.failed = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2 and self.trainer.global_rank == 1 and not self.failed:
            self.failed = True
            torch.empty(2**40, dtype=torch.uint8)  # raises: the CPU allocator cannot give a terabyte
        return super().training_step(batch, batch_idx)


def _recovery(rank: int, world: int) -> dict[str, Any]:
    auto = _fit(rank, world, AccelDDP(global_batch_size=24, micro_batch_size="auto", sync_batchnorm=False), 12,
                steps=5, model=_OOMOnce)  # fmt: skip
    fixed = _fit(rank, world, AccelDDP(global_batch_size=24, micro_batch_size=6, sync_batchnorm=False), 12, steps=5)
    return {"auto": auto, "fixed": fixed}


def test_an_out_of_memory_on_one_rank_is_recovered_on_both_at_the_same_step():
    for runs in run_distributed(_recovery, 2, init_process_group=False, timeout=180):
        # the whole loaded batch (12) until step 2, where rank 1 ran out: both ranks halve to 6 and redo step 2
        assert runs["auto"]["changes"] == [(2, 12, 6)] and runs["auto"]["micro"] == 6
        _close(runs["auto"]["state"], runs["fixed"]["state"])
    _close(runs["auto"]["state"], _reference(24, 5))


def _refusals(rank: int, world: int) -> dict[str, str]:
    messages = {}
    cases = {
        "syncbn": (AccelDDP(global_batch_size=24, micro_batch_size="auto"), BNModel),
        "buffers": (AccelDDP(global_batch_size=24, micro_batch_size="auto", sync_batchnorm=False), BNModel),
        "fsdp_syncbn": (AccelFSDP(global_batch_size=24, micro_batch_size="auto"), BNModel),
    }
    for name, (strategy, model) in cases.items():
        try:
            _fit(rank, world, strategy, 12, steps=1, model=model)
        except ValueError as err:
            messages[name] = str(err)
    return messages


def test_auto_refuses_forwards_with_collectives_and_bad_arguments_are_named():
    for messages in run_distributed(_refusals, 2, init_process_group=False, timeout=120):
        assert "SyncBatchNorm makes a collective in every forward" in messages["syncbn"]
        assert "buffer broadcast" in messages["buffers"] and "Fix: pass an int micro_batch_size" in messages["buffers"]
        assert messages["fsdp_syncbn"].startswith("AccelFSDP(micro_batch_size='auto') cannot recover")
        assert "SyncBatchNorm makes a collective in every forward. Fix:" in messages["fsdp_syncbn"]
    with pytest.raises(ValueError, match=r"micro_batch_size='big'\): expected an int or 'auto'"):
        AccelDDP(global_batch_size=8, micro_batch_size="big")


def test_batchnorm_statistics_are_per_micro_batch():
    """The documented behaviour: a split batch normalises each micro-batch with its own statistics."""
    split = _fit(0, 1, AccelDDP(global_batch_size=16, micro_batch_size=4), 16, steps=2, model=BNModel)
    pl.seed_everything(0, verbose=False)
    accumulated = BNModel()
    pl.Trainer(**small_trainer_kwargs(max_steps=2, accumulate_grad_batches=4)).fit(
        accumulated, make_loader(make_dataset(72), 4)
    )
    whole = _reference_bn(16)
    _close(split["state"], params_of(accumulated))  # 4 micro-batches of 4 == accumulating 4 loaded batches of 4
    assert not torch.allclose(split["state"]["net.1.running_var"], whole["net.1.running_var"])


def _reference_bn(batch: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = BNModel()
    pl.Trainer(**small_trainer_kwargs(max_steps=2)).fit(model, make_loader(make_dataset(72), batch))
    return params_of(model)


def test_fp16_loss_scaling_sees_one_unscale_per_step_with_split_batches():
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8))
    split = _fit(0, 1, AccelDDP(global_batch_size=16, micro_batch_size=4), 16, steps=3, plugins=[plugin])
    plain_plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8))
    plain = _fit(0, 1, AccelDDP(global_batch_size=16), 4, steps=3, plugins=[plain_plugin])
    _close(split["state"], plain["state"], atol=1e-3)  # fp16 compute in both, same micro-batches
    assert plugin.loss_scale == plain_plugin.loss_scale and plugin.skipped_steps == 0


def _run_capped(tmp: Path, budget_mb: float, micro: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"{micro}-{budget_mb}{''.join(extra)}.pt"
    # One malloc arena (its 64 MB reservations would eat the cap) and every large block mmapped (freed ones return
    # their address space), so the cap measures the tensors.
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--budget-mb", str(budget_mb), "--micro", micro, "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, timeout=240, capture_output=True, text=True), out


def _capped(tmp: Path, budget_mb: float, micro: str, *extra: str) -> dict[str, Any]:
    done, out = _run_capped(tmp, budget_mb, micro, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_auto_finds_the_largest_micro_batch_that_fits_under_a_real_memory_cap(tmp_path):
    # Measured (tests/scripts/micro_batch_oom.py): 16 per device needs at most 40 MB, 32 more than 54 MB, in every
    # step; 47 MB leaves 7 MB either side for the address space that other code takes, which varies between machines.
    auto = _capped(tmp_path, 47, "auto")
    assert auto["micro"] == 16 and auto["changes"] == [(0, 32, 16)]  # the first attempt ran out, the halved one fit
    fixed = _capped(tmp_path, 1e6, "16")  # no cap: the same micro-batch from the start
    joint = _capped(tmp_path, 1e6, "auto", "--reference")  # one process, batches of 64: the joint batch
    for key, value in auto["state"].items():
        assert torch.allclose(value, fixed["state"][key], atol=1e-5), key
        assert torch.allclose(value, joint["state"][key], atol=1e-5), key
