"""Micro-batching: loaded batches split into micro-batches, fixed or ``"auto"`` (the largest that fits in memory).

The training must not change: a split run equals one process on the joint batch (fp32, 1e-5), and ``"auto"`` equals a
run with the micro-batch it chose from the start, on real gloo processes with real allocation failures (a capped
address space, and a huge allocation on one rank). ``"auto"`` decides before the first optimizer step, and an
out-of-memory error later ends every rank with one message.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision, DynamicGradScaler
from lit_accel.strategies.parts._micro_batch_trials import SearchStopped, candidates, is_out_of_memory
from lit_accel.utilities._batches import batch_length, split_batch
from tests.helpers import (
    BNModel,
    DistributedTestError,
    make_dataset,
    make_loader,
    params_of,
    run_distributed,
    small_trainer_kwargs,
)
from tests.strategies.test_accel_fsdp import full_state


def test_split_batch_slices_every_tensor_of_nested_batches():
    batch = {"x": torch.arange(6), "pair": (torch.ones(6, 2), [torch.zeros(6)]), "name": "keep"}
    part = split_batch(batch, 2, 5)
    assert part["x"].tolist() == [2, 3, 4] and part["pair"][0].shape == (3, 2) and part["pair"][1][0].shape == (3,)
    assert part["name"] == "keep"
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert is_out_of_memory(MemoryError("std::bad_alloc")) and is_out_of_memory(torch.OutOfMemoryError("CUDA"))
    assert not is_out_of_memory(SearchStopped("a micro-batch of 1 sample(s) does not fit (1: out of memory)"))


@dataclasses.dataclass
class _Sample:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "disk"


def test_batches_lightning_can_move_split_too():
    # A dataclass batch and a defaultdict (both moved to the device by Lightning's apply_to_collection) were refused
    # (no tensor found) or failed (defaultdict's constructor) before.
    sample = _Sample(torch.arange(6), torch.ones(6, 2))
    assert batch_length(sample) == 6
    part = split_batch(sample, 2, 5)
    assert isinstance(part, _Sample) and part.image.tolist() == [2, 3, 4] and part.label.shape == (3, 2)
    assert part.source == "disk" and sample.image.shape == (6,)  # the loaded batch is left whole
    grouped = collections.defaultdict(list, x=torch.arange(6))
    split = split_batch(grouped, 0, 2)
    assert isinstance(split, collections.defaultdict) and split.default_factory is list
    assert split["x"].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"dim-0 sizes \['3', '4'\]"):
        batch_length(_Sample(torch.ones(3), torch.ones(4)))


def test_candidates_halve_from_the_loaded_batch():
    assert candidates(12) == [12, 6, 3, 2, 1] and candidates(32) == [32, 16, 8, 4, 2, 1] and candidates(1) == [1]


_SEARCH = """
import json, resource, sys, torch
from pathlib import Path
from lit_accel.strategies.parts import _micro_batch_search as search, _micro_batch_trials as trials

def vm_size():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmSize:"))
    return int(line.split()[1]) * 1024

MB, jump = 1_000_000, int(sys.argv[1])
def run(size):  # 5 MB per sample, touched; at `jump` samples 120 MB more: memory that no bound sees coming
    held = torch.ones(size * 5 * MB // 4 + (120 * MB // 4 if size >= jump else 0))
    del held

log = trials.SearchLog()
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 100 * MB, resource.RLIM_INFINITY))
try:
    chosen = search.by_measurement(run, lambda: None, 32, torch.device("cpu"), "Test", log, reserve_bytes=10 * MB)
    error = None
except Exception as err:
    chosen, error = None, trials.is_out_of_memory(err)
print(json.dumps({"chosen": chosen, "oom": error, "tried": [t.size for t in log.trials],
                  "largest": log.largest_fitting(), "report": log.describe()}))
"""


def _search_under_cap(jump: int) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _SEARCH, str(jump)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_measured_trials_keep_only_a_size_that_ran_within_the_margin_under_a_real_cap():
    """One process under a 100 MB address-space cap, 5 MB per sample and a 10 MB reserve held in every trial."""
    grows = _search_under_cap(jump=10**6)
    # 2 (20 MB), 4 (30), 8 (50); 16's bound from 8 (10 + 40 x 2 = 90 MB) passes 90% of the free space: a stepping
    # stone of the largest size in reach runs instead, and is kept (it ran)
    tried = grows["tried"]
    assert tried[:3] == [2, 4, 8] and 10 <= tried[3] < 16 and len(tried) == 4 and grows["chosen"] == tried[3], grows
    assert "16 not tried (may need" in grows["report"] and f"kept {grows['chosen']}" in grows["report"], grows
    # a jump no bound foresees: the trial of 8 runs out of memory; the search names the largest size that ran
    jumps = _search_under_cap(jump=8)
    assert jumps["oom"] is True and jumps["tried"] == [2, 4] and jumps["largest"] == 4, jumps


_ATTEMPTS = """
import json, resource, sys, torch
from pathlib import Path
from lit_accel.strategies.parts import _micro_batch_search as search, _micro_batch_trials as trials

def vm_size():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmSize:"))
    return int(line.split()[1]) * 1024

MB, jump, cap, leak = 1_000_000, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
LEFT = []  # what a failed attempt leaves held (`leak` MB from `jump`), as a failed allocation can
def attempt(size, limit=None):  # 10 MB of accumulated gradients, then 5 MB per sample (120 MB more from `jump`)
    grads = torch.ones(10 * MB // 4)
    if size >= jump and leak:
        LEFT.append(torch.ones(leak * MB // 4))
    for _ in range(min(-(-32 // size), limit or 32)):
        held = torch.ones(size * 5 * MB // 4 + (120 * MB // 4 if size >= jump else 0))
        del held
    del grads

log = trials.SearchLog()
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + cap * MB, resource.RLIM_INFINITY))
try:
    chosen, error = search.by_attempts(attempt, lambda: None, 32, torch.device("cpu"), "Test", log,
                                       reserve_bytes=10 * MB, fixed_bytes=10 * MB), None
except Exception as err:
    chosen, error = None, str(err)
print(json.dumps({"chosen": chosen, "error": error, "report": log.describe(),
                  "tried": [(t.size, t.whole, t.out_of_memory) for t in log.trials]}))
"""


def _attempts_under_cap(jump: int, cap_mb: int, leak_mb: int = 0) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _ATTEMPTS, str(jump), str(cap_mb), str(leak_mb)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_attempts_climb_from_a_probe_and_meet_a_tight_cap_without_a_failed_attempt():
    """One process under a real address-space cap: 10 MB held, 10 MB of gradients, 5 MB per sample (peak 20 + 5 n)."""
    # 100 MB: the probe (1 sample, two micro-batches) bounds 8 (60 MB) inside 90 MB and 16 (100 MB) outside
    roomy = _attempts_under_cap(jump=10**6, cap_mb=100)
    assert roomy["tried"] == [[1, False, False], [8, True, False]] and roomy["chosen"] == 8, roomy
    assert "1 (probe): peak" in roomy["report"] and "16 not tried" in roomy["report"], roomy
    # 31 MB: only one sample fits (25 MB; two take 30 MB, over the margin): kept, and nothing ran out of memory
    tight = _attempts_under_cap(jump=10**6, cap_mb=31)
    assert tight["chosen"] == 1 and not any(oom for _, _, oom in tight["tried"]), tight
    # a jump no bound foresees at 8: its attempt fails, the next candidate down is kept, 8 is not tried again
    jumps = _attempts_under_cap(jump=8, cap_mb=100)
    assert jumps["tried"] == [[1, False, False], [8, True, True], [4, True, False]] and jumps["chosen"] == 4, jumps
    # nothing fits: the search's own stop, never read back as a memory error of a size it tried
    none = _attempts_under_cap(jump=10**6, cap_mb=12)
    assert none["chosen"] is None and "does not fit in memory" in none["error"], none


def test_a_size_kept_before_a_failed_attempt_runs_again_after_it():
    """32 MB: 2's bound (30 MB) is within what is free, not within the margin: attempted, and it fails (`jump`)."""
    again = _attempts_under_cap(jump=2, cap_mb=32)
    assert again["tried"] == [[1, False, False], [1, True, False], [2, True, True], [1, True, False]], again
    assert again["chosen"] == 1, again
    # the failure left 10 MB held: 1 no longer fits, so nothing is kept, and the message says why and what to pass
    lost = _attempts_under_cap(jump=2, cap_mb=32, leak_mb=10)
    assert lost["chosen"] is None and lost["tried"][-1] == [1, True, True], lost
    assert "a micro-batch of 1 fitted, then a larger attempt ran out of memory" in lost["error"], lost
    assert "Fix: micro_batch_size=1 (it fits in a fresh process)" in lost["error"], lost


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
        "accumulation": trainer.accumulate_grad_batches,
        "rounds": getattr(strategy.comm_stats, "rounds", None),  # FSDP: reduce-scatter rounds
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


class _OOMAbove(BNModel):
    """Rank 1 fails a real allocation (a terabyte) in a forward of more than ``limit`` samples, at ``step`` only."""

    def __init__(self, limit: int, step: int | None = 0) -> None:
        super().__init__(batchnorm=False)
        self.limit, self.step, self.failed_at = limit, step, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if self.trainer.global_rank == 1 and len(batch[0]) > self.limit and self.step in (None, step):
            self.failed_at.append(step)
            torch.empty(2**40, dtype=torch.uint8)  # raises: the CPU allocator cannot give a terabyte
        return super().training_step(batch, batch_idx)


def _attempts(rank: int, world: int) -> dict[str, Any]:
    models: list[_OOMAbove] = []

    def failing() -> _OOMAbove:
        models.append(_OOMAbove(limit=6, step=None))  # more than 6 samples never fit on rank 1
        return models[-1]

    auto = _fit(rank, world, AccelDDP(global_batch_size=24, micro_batch_size="auto", sync_batchnorm=False), 12,
                steps=5, model=failing)  # fmt: skip
    fixed = _fit(rank, world, AccelDDP(global_batch_size=24, micro_batch_size=6, sync_batchnorm=False), 12, steps=5)
    return {"auto": auto, "fixed": fixed, "failed_at": models[0].failed_at}


def test_auto_attempts_agree_on_every_rank_before_the_first_step():
    for rank, runs in enumerate(run_distributed(_attempts, 2, init_process_group=False, timeout=180)):
        # the whole loaded batch (12) failed on rank 1 only, at step 0: both ranks halve to 6 before any step
        assert runs["auto"]["micro"] == 6 and runs["failed_at"] == ([0] if rank == 1 else [])
        _close(runs["auto"]["state"], runs["fixed"]["state"])
    _close(runs["auto"]["state"], _reference(24, 5))


def _fails_later(rank: int, world: int) -> None:
    strategy = AccelDDP(global_batch_size=24, micro_batch_size=6, sync_batchnorm=False)
    _fit(rank, world, strategy, 12, steps=5, model=lambda: _OOMAbove(limit=5, step=2))


def test_an_out_of_memory_during_training_ends_every_rank_with_the_size_that_would_fit():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fails_later, 2, init_process_group=False, timeout=120)
    message = str(info.value)
    assert "did not finish" not in message and time.monotonic() - started < 90  # no rank left waiting
    assert "AccelDDP: out of memory in a micro-batch of 6 samples. Fix: micro_batch_size=3." in message
    assert message.count("Error") >= 2  # rank 0 stopped too, at its next collective


class _StatefulModel(BNModel):
    """BatchNorm (buffers broadcast by DDP, synchronised under SyncBN): forwards with collectives."""

    def __init__(self) -> None:
        super().__init__(batchnorm=True)


def _measured(rank: int, world: int) -> dict[str, Any]:

    runs = {}
    for name, make in (
        ("ddp_syncbn", lambda m: AccelDDP(global_batch_size=24, micro_batch_size=m)),
        ("ddp_buffers", lambda m: AccelDDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False)),
        ("fsdp", lambda m: AccelFSDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False)),
        # torch < 2.14 (no reset_iter_state): trials with FSDP's collectives instead of gathered attempts
        ("fsdp_trials", lambda m: _TrialsFSDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False)),
    ):
        runs[name] = _fit(rank, world, make("auto"), 12, steps=3, model=_StatefulModel)
        runs[name + "_fixed"] = _fit(rank, world, make(runs[name]["micro"]), 12, steps=3, model=_StatefulModel)
    # inside Lightning's accumulation window: loaded batches of 6, two per step (the search runs in the first)
    window = lambda m: AccelFSDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False)  # noqa: E731
    runs["fsdp_window"] = _fit(rank, world, window("auto"), 6, steps=3, model=_StatefulModel)
    runs["fsdp_window_fixed"] = _fit(rank, world, window(runs["fsdp_window"]["micro"]), 6, steps=3,
                                     model=_StatefulModel)  # fmt: skip
    return runs


class _TrialsFSDP(AccelFSDP):
    """AccelFSDP as on torch < 2.14, where its attempts cannot gather every parameter."""

    def without_collectives(self) -> None:
        return None


def test_auto_measures_where_forwards_make_collectives_and_leaves_no_trace():
    """SyncBatchNorm, DDP's buffer broadcast and FSDP's all-gathers: the search measures runs that it cannot undo
    by catching, and must leave nothing behind (gradients, FSDP's state, running statistics, reducer state)."""
    for runs in run_distributed(_measured, 2, init_process_group=False, timeout=300):
        for name in ("ddp_syncbn", "ddp_buffers", "fsdp", "fsdp_trials", "fsdp_window"):
            assert runs[name]["micro"] == runs[name + "_fixed"]["micro"] >= 1, name
            _close(runs[name]["state"], runs[name + "_fixed"]["state"])  # running statistics included
        assert runs["fsdp_window"]["accumulation"] == 2


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
