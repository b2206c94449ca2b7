"""AccelDDP (issue #3, strategy part): construction, registry, SyncBatchNorm wiring, comm hooks on gloo, backend.

Distributed behaviour runs in real forked gloo ranks; the pytest process never creates a process group, so the
single-process references below use Lightning's default single-device strategy.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from lit_accel import AccelDDP, AccelSyncBatchNorm
from lit_accel.protocols import CommStats
from lit_accel.strategies.ddp._comm_hooks import resolve_comm_hook
from lit_accel.strategies.parts._comm_stats import HookCommStats
from lit_accel.utilities._compat import ddp_logging_data, ddp_sampled_round
from tests.helpers import (
    BNModel,
    lightning_info_messages,
    make_dataset,
    make_loader,
    params_of,
    run_distributed,
    small_trainer_kwargs,
)
from tests.helpers.torch_features import DDP_PASS_THROUGH

ATOL = 1e-5


def _assert_states_close(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


# ----------------------------------------------------------------------------------------------------------------
# Construction and registry (no processes)
# ----------------------------------------------------------------------------------------------------------------


def _two_arg_lambda(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"global_batch_size": 0}, ValueError, r"global_batch_size=0\): expected an int >= 1"),
        ({"global_batch_size": 2.5}, TypeError, r"global_batch_size=2.5\)"),
        ({"global_batch_size": True}, TypeError, r"global_batch_size=True\)"),
        ({"micro_batch_size": 0}, ValueError, r"micro_batch_size=0\): expected an int >= 1"),
        ({"micro_batch_size": "big"}, ValueError, r"micro_batch_size='big'\): expected an int or 'auto'"),
        ({"partial_window": "sum"}, ValueError, r"partial_window='sum'\): expected one of 'mean', 'lightning'"),
        ({"sync_batchnorm": "yes"}, TypeError, r"sync_batchnorm='yes'\): expected True, False or an AccelSync"),
        ({"static_graph": 1}, TypeError, r"static_graph=1\)"),
        ({"comm_hook": "fp8"}, ValueError, r"comm_hook='fp8'\): expected one of 'fp16', 'bf16', 'powersgd'"),
        ({"comm_hook": 42}, TypeError, r"comm_hook=42\)"),
        ({"comm_hook": lambda bucket: bucket}, TypeError, r"cannot be called as hook\(state, bucket\).*Fix"),
        ({"comm_hook": "fp16", "comm_state": object()}, ValueError, r"comm_state=object\(...\)\) needs comm_hook="),
        ({"comm_hook": "powersgd", "comm_state": "state"}, TypeError, r"expected a PowerSGDState"),
        (
            {"comm_hook": _two_arg_lambda, "comm_state": post_localSGD_hook.PostLocalSGDState(None, None, 10)},
            ValueError,
            r"PostLocalSGDState.*Fix: pass model_averaging_period",
        ),
        ({"model_averaging_period": 4}, ValueError, r"model_averaging_period=4\) only applies to post-local SGD"),
        ({"comm_wrapper": default_hooks.fp16_compress_wrapper}, ValueError, r"comm_wrapper=...\).*Fix: pass comm_hook"),
        ({"bucket_cap_mb": -1}, ValueError, r"bucket_cap_mb=-1\): expected a finite number > 0 or None\. Fix"),
        ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb=0\)"),
        ({"bucket_cap_mb": math.nan}, ValueError, r"bucket_cap_mb=nan\)"),
        ({"bucket_cap_mb": "25"}, TypeError, r"bucket_cap_mb='25'\)"),
        ({"process_group_backend": "cpu:"}, ValueError, r"process_group_backend='cpu:'\).*'cpu:gloo,cuda:nccl'"),
        ({"process_group_backend": 3}, TypeError, r"process_group_backend=3\)"),
        (
            {"ddp_comm_hook": default_hooks.fp16_compress_hook, "comm_hook": "bf16"},
            ValueError,
            r"ddp_comm_hook=..., comm_hook=...\): two values for the same argument",
        ),
        ({"bucket_size": 3}, TypeError, r"unknown argument\(s\) \['bucket_size'\].*static_graph"),
    ],
)
def test_bad_arguments_raise_at_construction_naming_the_value(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        AccelDDP(**kwargs)


def test_good_arguments_reach_distributed_data_parallel():
    powersgd = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=5)
    extra = {DDP_PASS_THROUGH: False}  # passes through to DistributedDataParallel
    strategy = AccelDDP(comm_hook="powersgd", comm_state=powersgd, bucket_cap_mb=10, **extra)
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, **extra, "bucket_cap_mb": 10}
    assert isinstance(strategy.comm_stats, HookCommStats) and strategy.comm_stats.calls == 0
    assert strategy.global_batch_size is None and strategy.micro_batch_size is None
    assert AccelDDP(global_batch_size=64).global_batch_size == 64


def test_registered_names_and_start_methods():
    expected = {
        "accel_ddp": "popen",
        "accel_ddp_spawn": "spawn",
        "accel_ddp_fork": "fork",
        "accel_ddp_notebook": "fork",
    }
    for name, start_method in expected.items():
        assert name in StrategyRegistry.available_strategies()
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is AccelDDP and strategy._start_method == start_method
    AccelDDP.register_strategies(StrategyRegistry)  # idempotent: a second registration neither raises nor replaces
    assert StrategyRegistry["accel_ddp"]["strategy"] is AccelDDP
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="accel_ddp", logger=False)
    assert isinstance(trainer.strategy, AccelDDP)


def test_strategy_pickles_for_spawn_with_its_counters():
    strategy = AccelDDP(global_batch_size=64, comm_hook="powersgd")
    strategy.comm_stats.calls, strategy.comm_stats.bytes = 3, 120
    restored = pickle.loads(pickle.dumps(strategy))
    assert (restored.comm_stats.calls, restored.comm_stats.bytes) == (3, 120)
    assert restored.global_batch_size == 64 and restored.comm_stats.pop_elapsed_s() == 0.0
    # The default's counters travel too (no DDP model is attached before the processes start).
    default = pickle.loads(pickle.dumps(AccelDDP()))
    assert (default.comm_stats.calls, default.comm_stats.bytes, default.comm_stats.pop_elapsed_s()) == (0, 0, 0.0)


def test_one_comm_stats_kind_whatever_the_hook_and_it_satisfies_the_protocol():
    default, hooked = AccelDDP(), AccelDDP(comm_hook="bf16")
    assert type(default.comm_stats) is HookCommStats and type(hooked.comm_stats) is HookCommStats
    assert isinstance(default.comm_stats, CommStats) and isinstance(hooked.comm_stats, CommStats)


def test_comm_stats_elapsed_time_is_the_union_of_intervals(monkeypatch):
    stats = HookCommStats()
    clock = iter([0.0, 1.0, 2.0, 3.0, 5.0, 6.0])  # starts and ends of three collectives, the first two overlap
    monkeypatch.setattr("lit_accel.strategies.parts._comm_stats.time.perf_counter", lambda: next(clock))
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(torch.zeros(1))
    first, second = stats.start(torch.device("cpu")), stats.start(torch.device("cpu"))  # 0.0, 1.0
    stats.finish(first, done)  # 2.0
    stats.finish(second, done)  # 3.0
    third = stats.start(torch.device("cpu"))  # 5.0
    stats.finish(third, done)  # 6.0
    assert stats.pop_elapsed_s() == pytest.approx(3.0 + 1.0)  # [0, 3] and [5, 6]
    assert stats.pop_elapsed_s() == 0.0


def test_comm_stats_fold_pending_intervals_when_nobody_pops(monkeypatch):
    monkeypatch.setattr("lit_accel.strategies.parts._comm_stats._MAX_PENDING", 3)
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("lit_accel.strategies.parts._comm_stats.time.perf_counter", lambda: next(clock))
    stats = HookCommStats()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(torch.zeros(1))
    for _ in range(10):  # ten disjoint collectives of 1 s each: [0, 1], [2, 3], ...
        stats.finish(stats.start(torch.device("cpu")), done)
        assert len(stats._cpu_intervals) <= 3
    assert stats.pop_elapsed_s() == pytest.approx(10.0)


# ----------------------------------------------------------------------------------------------------------------
# SyncBatchNorm (real processes)
# ----------------------------------------------------------------------------------------------------------------


class _UserBatchNorm(nn.BatchNorm1d):
    """A user subclass: the class AccelDDP must give back after fit."""

    marker = "user"


class _ClassRecorder(pl.Callback):
    def __init__(self) -> None:
        self.during_fit: set[str] = set()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.during_fit.add(type(pl_module.net[1]).__name__)


def _bn_model(batchnorm: bool = True) -> BNModel:
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=batchnorm)
    if batchnorm:
        model.net[1] = _UserBatchNorm(model.net[1].num_features)
    return model


def _fit_bn(
    rank: int, world_size: int, strategy: Any, batch_size: int, batchnorm: bool = True, fits: int = 1, **kwargs: Any
) -> dict:
    model = _bn_model(batchnorm)
    recorder = _ClassRecorder()
    trainer_kwargs = small_trainer_kwargs(max_steps=3, callbacks=[recorder], **kwargs)
    if strategy is not None:
        trainer_kwargs.update(devices=world_size, strategy=strategy, use_distributed_sampler=False)
        loader = make_loader(make_dataset(48), batch_size, rank, world_size)
    else:
        loader = make_loader(make_dataset(48), batch_size)
    trainer = pl.Trainer(**trainer_kwargs)
    with lightning_info_messages() as messages:
        for _ in range(fits):
            trainer.fit(model, loader)
    return {
        "state": params_of(model),
        "class_after": type(model.net[1]),
        "during_fit": recorder.during_fit,
        "messages": messages,
    }


def _syncbn_runs(rank: int, world_size: int) -> dict[str, dict]:
    runs = {
        "default": _fit_bn(rank, world_size, AccelDDP(), 4),
        "trainer_flag": _fit_bn(rank, world_size, AccelDDP(), 4, sync_batchnorm=True),
    }
    # Two fits of a model without BatchNorm by the same Trainer: the user is told once.
    runs["no_batchnorm"] = _fit_bn(rank, world_size, AccelDDP(), 4, batchnorm=False, fits=2)
    return runs


@pytest.fixture(scope="module")
def syncbn_runs() -> list[dict[str, dict]]:
    return run_distributed(_syncbn_runs, 2, init_process_group=False, timeout=120)


def test_syncbn_two_ranks_equal_one_process_on_the_joint_batch_and_classes_come_back(syncbn_runs):
    # Each rank sees 4 samples per step; their union is the 8-sample batch of the sequential reference.
    reference = _fit_bn(0, 1, None, 8)
    assert reference["during_fit"] == {"_UserBatchNorm"}
    for ranks in syncbn_runs:
        for case in ("default", "trainer_flag"):
            run = ranks[case]
            assert run["during_fit"] == {"SyncBatchNorm"}
            assert run["class_after"] is _UserBatchNorm  # the user's class, not BatchNorm1d or _BatchNormXd
            _assert_states_close(run["state"], reference["state"])  # same keys, parameters and running stats
    for case in ("default", "trainer_flag"):
        _assert_states_close(syncbn_runs[0][case]["state"], syncbn_runs[1][case]["state"], atol=0)
    assert "running_mean" in "".join(reference["state"])  # the comparison covers the running statistics


def test_syncbn_messages_replacing_torch_and_no_batchnorm_once(syncbn_runs):
    rank0 = syncbn_runs[0]
    assert any("Trainer(sync_batchnorm=True) is replaced" in m for m in rank0["trainer_flag"]["messages"])
    assert not any("is replaced" in m for m in rank0["default"]["messages"])
    no_bn = [m for m in rank0["no_batchnorm"]["messages"] if "no BatchNorm layer" in m]
    assert len(no_bn) == 1 and "sync_batchnorm=False" in no_bn[0]
    assert not any("no BatchNorm layer" in m for m in rank0["default"]["messages"])
    assert not any("no BatchNorm layer" in m for m in syncbn_runs[1]["no_batchnorm"]["messages"])  # rank zero only


def _grouped_running_stats(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = BNModel()
    kwargs = small_trainer_kwargs(devices=world_size, max_steps=1, use_distributed_sampler=False)
    strategy = AccelDDP(sync_batchnorm=AccelSyncBatchNorm(group_size=2))
    pl.Trainer(strategy=strategy, **kwargs).fit(model, make_loader(make_dataset(32), 4, rank, world_size))
    assert strategy.sync_bn_group_size == 2
    return {k: v for k, v in params_of(model).items() if "running" in k}


def test_sync_bn_group_size_synchronises_consecutive_ranks_only():
    stats = run_distributed(_grouped_running_stats, 4, init_process_group=False, timeout=120)
    x, _ = make_dataset(32).tensors
    for group in ((0, 1), (2, 3)):
        # The first batch of rank r is samples r, r + 4, r + 8, r + 12 (non-shuffling DistributedSampler).
        joint = torch.cat([x[r::4][:4] for r in group])
        pl.seed_everything(0, verbose=False)
        reference = BNModel().train()
        reference(joint)
        expected = {k: v for k, v in params_of(reference).items() if "running" in k}
        for r in group:
            _assert_states_close(stats[r], expected)
    assert not torch.allclose(stats[0]["net.1.running_mean"], stats[2]["net.1.running_mean"])


# ----------------------------------------------------------------------------------------------------------------
# Comm hooks on gloo (real processes)
# ----------------------------------------------------------------------------------------------------------------


class _CountingAllReduce:
    """A user hook: torch's all-reduce mean, counting its own calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        self.calls += 1
        return default_hooks.allreduce_hook(state, bucket)


class _StepRecorder(pl.Callback):
    def __init__(self, timed: bool = False) -> None:
        self.timed = timed
        self.states: list[dict[str, torch.Tensor]] = []
        self.calls: list[int] = []
        self.bytes: list[int] = []
        self.ddp: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timed:  # as the EfficiencyMonitor does: before the strategy's on_train_start decides
            trainer.strategy.comm_stats.request_timing()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model  # after the strategy's on_train_start, which may register the default's hook
        self.ddp = {
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph,
            "find_unused_parameters": ddp.find_unused_parameters,
            "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "comm_hook": ddp_logging_data(ddp).get("comm_hook"),  # DDP logs a hook's name only when one is registered
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.states.append(params_of(pl_module))
        self.calls.append(trainer.strategy.comm_stats.calls)
        self.bytes.append(trainer.strategy.comm_stats.bytes)


_HOOKS: dict[str, dict[str, Any]] = {
    "default": {},  # no hook: DDP's own all-reduce, counted without one
    "timed": {},  # the default, with a consumer that asks for timing: torch's all-reduce hook, wrapped
    "fp16": {"comm_hook": "fp16"},
    "bf16": {"comm_hook": "bf16"},
    "powersgd": {"comm_hook": "powersgd"},  # a PowerSGDState(start_powerSGD_iter=2) is made in each run
    "callable": {},
}
_STEPS = 4


def _hook_runs(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, hook_kwargs in _HOOKS.items():
        user_hook = _CountingAllReduce() if name == "callable" else None
        if user_hook is not None:
            hook_kwargs = {"comm_hook": user_hook}
        if name == "powersgd":
            hook_kwargs = {**hook_kwargs, "comm_state": powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2)}
        pl.seed_everything(0, verbose=False)
        model = BNModel(batchnorm=False)
        recorder = _StepRecorder(timed=name == "timed")
        strategy = AccelDDP(sync_batchnorm=False, **hook_kwargs)
        kwargs = small_trainer_kwargs(devices=world_size, max_steps=_STEPS, use_distributed_sampler=False)
        trainer = pl.Trainer(strategy=strategy, callbacks=[recorder], **kwargs)
        trainer.fit(model, make_loader(make_dataset(48), 4, rank, world_size))
        results[name] = {
            "states": recorder.states,
            "calls": recorder.calls,
            "bytes": recorder.bytes,
            "elapsed": (strategy.comm_stats.pop_elapsed_s(), strategy.comm_stats.pop_elapsed_s()),
            "user_calls": user_hook.calls if user_hook is not None else None,
            "ddp": recorder.ddp,
        }
        results["backend"] = (strategy.process_group_backend, dist.get_backend())
    return results


@pytest.fixture(scope="module")
def hook_runs() -> list[dict[str, Any]]:
    return run_distributed(_hook_runs, 2, init_process_group=False, timeout=120)


def _per_step(cumulative: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *cumulative], cumulative)]


def _powersgd_numel(model: nn.Module, rank: int = 1, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD all-reduces per step: P and Q (n + m) x r for matrices worth compressing, else n x m."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


@pytest.mark.parametrize("hook", list(_HOOKS))
def test_comm_hook_trains_on_gloo_and_ranks_stay_identical(hook_runs, hook):
    rank0, rank1 = (ranks[hook] for ranks in hook_runs)
    assert len(rank0["states"]) == _STEPS
    for step in range(_STEPS):
        _assert_states_close(rank0["states"][step], rank1["states"][step], atol=0)
    pl.seed_everything(0, verbose=False)
    initial = params_of(BNModel(batchnorm=False))
    final = rank0["states"][-1]
    assert all(torch.isfinite(v).all() for v in final.values())
    assert all(not torch.equal(final[k], initial[k]) for k in initial)
    default = hook_runs[0]["default"]["states"]
    if hook in ("default", "timed", "callable"):
        _assert_states_close(final, default[-1], atol=0)
    elif hook in ("fp16", "bf16"):
        # Compressed to 16 bits on the wire: close to the fp32 all-reduce, but not equal (the hook really ran).
        _assert_states_close(final, default[-1], atol=2e-2)
        assert any(not torch.equal(final[k], default[-1][k]) for k in final)
    else:
        # PowerSGD all-reduces plainly before start_powerSGD_iter (2 steps), then compresses.
        _assert_states_close(rank0["states"][1], default[1], atol=0)
        assert any(not torch.equal(final[k], default[-1][k]) for k in final)


def test_comm_stats_count_collectives_and_bytes_per_hook(hook_runs):
    model = BNModel(batchnorm=False)
    numel = sum(p.numel() for p in model.parameters())
    for ranks in hook_runs:
        # The user's own hook counts one call per bucket: the unit for every one-collective hook. "default" has no
        # hook (its rounds are counted by the strategy, its buckets read from DDP's layout), so it must match what
        # the user's hook saw really happen.
        buckets = ranks["callable"]["user_calls"] // _STEPS
        assert buckets >= 1 and ranks["callable"]["user_calls"] == _STEPS * buckets
        expected = {
            "default": ([buckets] * _STEPS, [4 * numel] * _STEPS),
            "timed": ([buckets] * _STEPS, [4 * numel] * _STEPS),
            "callable": ([buckets] * _STEPS, [4 * numel] * _STEPS),
            "fp16": ([buckets] * _STEPS, [2 * numel] * _STEPS),
            "bf16": ([buckets] * _STEPS, [2 * numel] * _STEPS),
            "powersgd": (
                [buckets] * 2 + [3 * buckets] * (_STEPS - 2),  # then uncompressed tensors, P and Q
                [4 * numel] * 2 + [4 * _powersgd_numel(model)] * (_STEPS - 2),
            ),
        }
        for hook, (calls, nbytes) in expected.items():
            assert _per_step(ranks[hook]["calls"]) == calls, hook
            assert _per_step(ranks[hook]["bytes"]) == nbytes, hook
            elapsed, elapsed_again = ranks[hook]["elapsed"]
            if hook == "default":  # no hook; after the fit its model is released: no rounds left to estimate
                assert (elapsed, elapsed_again) == (0.0, 0.0)
            else:
                assert elapsed > 0.0 and elapsed_again == 0.0


def test_backend_is_chosen_from_the_accelerator(hook_runs):
    assert [ranks["backend"] for ranks in hook_runs] == [("gloo", "gloo")] * 2


def test_ddp_defaults_reach_the_wrapped_module(hook_runs):
    assert hook_runs[0]["default"]["ddp"] == {
        "gradient_as_bucket_view": True,
        "static_graph": False,
        "find_unused_parameters": False,
        "bucket_bytes_cap": 25 * 1024 * 1024,  # torch's default bucket_cap_mb
        "comm_hook": None,  # no Python hook: DDP's own C++ all-reduce, counted without one
    }


def test_every_comm_hook_is_wrapped_and_torchs_all_reduce_once_timing_is_asked_for(hook_runs):
    for ranks in hook_runs:
        assert ranks["default"]["ddp"]["comm_hook"] is None
        assert ranks["timed"]["ddp"]["comm_hook"] == "accel_counting_hook(allreduce_hook)"
        assert ranks["fp16"]["ddp"]["comm_hook"] == "accel_counting_hook(fp16_compress_hook)"
        assert ranks["powersgd"]["ddp"]["comm_hook"] == "accel_counting_hook(powerSGD_hook)"
        assert ranks["callable"]["ddp"]["comm_hook"].startswith("accel_counting_hook(")


# ----------------------------------------------------------------------------------------------------------------
# The default's counters against really counted all-reduces (real processes)
# ----------------------------------------------------------------------------------------------------------------

# 104-byte buckets: DDP builds one bucket at construction (its first bucket may hold 1 MiB) and, after the first
# backward, rebuilds them in gradient-ready order into several, so the bucket count changes between rounds.
_TINY_BUCKET_MB = 1e-4


class _ManualThreeBackward(BNModel):
    """Manual optimization with three backward passes per step, the first under ``block_backward_sync()``."""

    def __init__(self) -> None:
        super().__init__(batchnorm=False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        # Lightning keeps DDP's forward from preparing the reducer in manual optimization; DDPStrategy.pre_backward
        # prepares it before each manual_backward outside no_sync(): no round here, then one per call below.
        with self.trainer.strategy.block_backward_sync():
            self.manual_backward(loss / 3, retain_graph=True)
        self.manual_backward(loss / 3, retain_graph=True)
        self.manual_backward(loss / 3)
        optimizer.step()
        optimizer.zero_grad()
        return loss


class _CounterRecorder(pl.Callback):
    """``comm_stats`` after every batch; for the default also its rounds and the pops (``timed``: asked for first)."""

    def __init__(self, pop: bool, timed: bool) -> None:
        self.pop, self.timed = pop, timed
        self.calls: list[int] = []
        self.bytes: list[int] = []
        self.pops: list[float] = []
        self.rounds: list[int] = []
        self.samples: list[Any] = []
        self.step_s: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.timed:
            trainer.strategy.comm_stats.request_timing()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        stats = trainer.strategy.comm_stats
        self.calls.append(stats.calls)
        self.bytes.append(stats.bytes)
        if self.pop:
            self.rounds.append(stats.rounds)
            self.samples.append(ddp_sampled_round(trainer.strategy.model))  # what the default's pop reads
            self.pops.append(stats.pop_elapsed_s())


def _counter_run(rank: int, world_size: int, manual: bool, mode: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    hook = _CountingAllReduce() if mode == "counted" else None
    strategy = AccelDDP(sync_batchnorm=False, bucket_cap_mb=_TINY_BUCKET_MB, comm_hook=hook)
    recorder = _CounterRecorder(pop=mode != "counted", timed=mode == "timed")
    model = _ManualThreeBackward() if manual else BNModel(batchnorm=False)
    kwargs = small_trainer_kwargs(
        devices=world_size, max_steps=-1, max_epochs=1, use_distributed_sampler=False, callbacks=[recorder]
    )
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    loader = make_loader(make_dataset(24), 4, rank, world_size)  # 3 steps per epoch
    trainer.fit(model, loader)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, loader)  # a second fit: a new DDP model, the same counters
    return {
        "calls": recorder.calls,
        "bytes": recorder.bytes,
        "pops": recorder.pops,
        "rounds": recorder.rounds,
        "samples": recorder.samples,
        "step_s": recorder.step_s,
        "hook_calls": hook.calls if hook is not None else None,
        "final": (strategy.comm_stats.calls, strategy.comm_stats.bytes),
    }


def _counter_runs(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    # default: no hook (nobody asks for timing); timed: the default once a consumer asked; counted: a user's hook
    return {
        f"{'manual' if manual else 'automatic'}-{mode}": _counter_run(rank, world_size, manual, mode)
        for manual in (False, True)
        for mode in ("default", "timed", "counted")
    }


@pytest.fixture(scope="module")
def counter_runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_counter_runs, 2, init_process_group=False, timeout=120)


def test_default_counters_equal_the_counted_all_reduces_with_one_round_per_synchronised_backward(counter_runs):
    numel = sum(p.numel() for p in BNModel(batchnorm=False).parameters())
    for ranks in counter_runs:
        # Automatic: one round per step; manual: the two manual_backward calls outside no_sync(). DDP rebuilds its
        # buckets before the second round, so the bucket count per round changes.
        for optimization, rounds_per_step in (("automatic", 1), ("manual", 2)):
            counted = ranks[f"{optimization}-counted"]
            assert len(counted["calls"]) == 6  # two fits of 3 steps
            # A user's counting hook saw every bucket DDP reduced; the wrapper's counters agree with it ...
            assert counted["hook_calls"] == counted["calls"][-1]
            per_step_calls = _per_step(counted["calls"])
            assert len(set(per_step_calls)) > 1  # (the layout really changes)
            # ... and the default counts the same collectives at every read: without a hook (DDP's all-reduce, the
            # rounds counted by the strategy, the buckets from DDP's layout) and timed (torch's all-reduce, wrapped)
            for mode in ("default", "timed"):
                default = ranks[f"{optimization}-{mode}"]
                assert default["calls"] == counted["calls"], (optimization, mode)
                assert default["final"] == counted["final"], (optimization, mode)
                # Bytes: every fp32 gradient once per round; rounds: the synchronised backward passes, nothing else.
                assert _per_step(default["bytes"]) == [rounds_per_step * 4 * numel] * 6
                assert default["rounds"] == [rounds_per_step * (step + 1) for step in range(6)], (optimization, mode)


def test_default_elapsed_time_is_measured_inside_each_step_once_asked_for_and_estimated_otherwise(counter_runs):
    for ranks in counter_runs:
        for optimization in ("automatic", "manual"):
            run = ranks[f"{optimization}-timed"]
            assert len(run["pops"]) == 6
            for step, pop in enumerate(run["pops"]):
                # the all-reduces of this step, timed by the hook: some time, never more than the step took
                assert 0.0 < pop <= run["step_s"][step], (optimization, step)
            # Nobody asked: no hook, the rounds since the last pop x DDP's latest sampled round (none in a fit's first
            # step: DDP publishes a round at the next synchronised forward).
            default = ranks[f"{optimization}-default"]
            rounds = _per_step(default["rounds"])
            expected = [n * sample[1] if sample else 0.0 for n, sample in zip(rounds, default["samples"])]
            assert default["pops"] == expected and expected.count(0.0) == 2, optimization  # the two fits' first


# ----------------------------------------------------------------------------------------------------------------
# Refusals at setup (real processes)
# ----------------------------------------------------------------------------------------------------------------


def _setup_error(rank: int, world_size: int, strategy: AccelDDP, **trainer_kwargs: Any) -> str:
    kwargs = small_trainer_kwargs(devices=world_size, max_steps=1, use_distributed_sampler=False)
    kwargs.update(trainer_kwargs)
    try:
        pl.Trainer(strategy=strategy, **kwargs).fit(BNModel(), make_loader(make_dataset(16), 4, rank, world_size))
    except ValueError as err:
        return str(err)
    return ""


def _setup_errors(rank: int, world_size: int) -> dict[str, str]:
    return {
        "nccl_on_cpu": _setup_error(rank, world_size, AccelDDP(process_group_backend="nccl")),
        "group_size": _setup_error(rank, world_size, AccelDDP(sync_batchnorm=AccelSyncBatchNorm(group_size=3))),
        "contradiction": _setup_error(rank, world_size, AccelDDP(sync_batchnorm=False), sync_batchnorm=True),
    }


@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        ("nccl_on_cpu", [r"process_group_backend='nccl'\) needs CUDA", "Fix: drop process_group_backend"]),
        ("group_size", [r"group_size=3\)\) must divide the world size 2", r"Allowed: \[1, 2\]", "Fix"]),
        ("contradiction", [r"sync_batchnorm=False\) contradicts Trainer\(sync_batchnorm=True\)", "Fix"]),
    ],
)
def test_world_dependent_errors_raise_at_setup(setup_errors, case, patterns):
    import re

    for ranks in setup_errors:
        for pattern in patterns:
            assert re.search(pattern, ranks[case]), (pattern, ranks[case])


@pytest.fixture(scope="module")
def setup_errors() -> list[dict[str, str]]:
    return run_distributed(_setup_errors, 2, init_process_group=False, timeout=120)


@pytest.mark.slow
def test_accel_ddp_spawn_launches_two_processes_and_reverts_batchnorm():
    """Lightning's own launcher with the registered name (spawn re-imports everything: ~15 s on 2 cores)."""
    model = _bn_model()
    before = params_of(model)
    trainer = pl.Trainer(**small_trainer_kwargs(devices=2, strategy="accel_ddp_spawn", max_steps=2))
    trainer.fit(model, make_loader(make_dataset(32), 4))
    assert isinstance(trainer.strategy, AccelDDP) and trainer.world_size == 2
    assert type(model.net[1]) is _UserBatchNorm
    assert not torch.equal(params_of(model)["net.0.weight"], before["net.0.weight"])


def test_a_callable_hook_without_state_gets_ddps_process_group():
    # torch's hooks reduce over their state's group (None: the world); with DDP(process_group=...) they must get that.
    group = object()
    _, state, kind = resolve_comm_hook(default_hooks.allreduce_hook, None, None, group)
    assert state is group and kind == "custom"
    mine = object()
    assert resolve_comm_hook(default_hooks.allreduce_hook, mine, None, group)[1] is mine


def test_sync_bn_group_size_reports_the_trainers_own_plugin():
    strategy = AccelDDP()
    trainer = pl.Trainer(strategy=strategy, plugins=[AccelSyncBatchNorm(group_size=1)], **small_trainer_kwargs())
    trainer.fit(BNModel(), make_loader(make_dataset(16), 4))
    assert strategy.sync_bn_group_size == 1  # the Trainer's plugin, not the strategy's default (None: all ranks)
