"""Exposed communication and straggler attribution, measured on real gloo processes (2 and 4 ranks).

Delays are made with sleeps whose length the tests know: a comm hook whose buckets complete a known time after their
all-reduce (so after the backward of this tiny model), a backward that goes on longer than that delay (hiding it), or
one rank whose backward or training step sleeps. Time is wall-clock on a loaded machine, so the bounds are 25%.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lit_accel import AccelDDP, AccelFSDP, EfficiencyMonitor
from tests.helpers import BNModel, CaptureLogger, make_dataset, make_loader, run_distributed, small_trainer_kwargs
from tests.helpers.dispatch import OpRecorder

DELAY_S = 0.03
SLOW_STEP_S = 0.06  # a straggler's extra step time: several times this machine's step (4 processes: ~30 ms)
EQUAL_STEP_S = 0.03
STEPS, EVERY = 16, 4
LOGGED = len(range(EVERY - 1, STEPS, EVERY))  # logging steps 3, 7, 11, 15 (warm-up: steps 0 and 1)


APPLIED_DELAYS_S: list[float] = []  # in each rank's process: how long each bucket was really held back
SLEPT_S: list[float] = []  # ... and how long each sleep of the model really lasted (a busy machine wakes late)


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    SLEPT_S.append(time.perf_counter() - start)


def _mean_ms(values: list[float]) -> float:
    return 1e3 * sum(values) / len(values) if values else 0.0


def _delayed_allreduce(state, bucket):  # no annotations: DDP compares them with its own types
    """torch's all-reduce hook, whose bucket completes DELAY_S after the all-reduce did (off the training thread)."""
    fut = default_hooks.allreduce_hook(state, bucket)
    done: torch.futures.Future = torch.futures.Future()

    def release(reduced: torch.futures.Future, since: float) -> None:
        APPLIED_DELAYS_S.append(time.perf_counter() - since)  # the timer's own lateness included
        done.set_result(reduced.value())

    fut.add_done_callback(lambda f: threading.Timer(DELAY_S, release, (f, time.perf_counter())).start())
    return done


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: placed before the layers it runs after their gradients, after them before."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sleep(ctx.seconds)
        return grad, None


class _Model(BNModel):
    def __init__(self, hide_s=0.0, slow_rank=-1, backward_s=0.0, step_s=0.0, line_up=False) -> None:
        super().__init__(batchnorm=False)
        self.hide_s, self.slow_rank, self.backward_s, self.step_s = hide_s, slow_rank, backward_s, step_s
        self.line_up = line_up

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.line_up:  # start every rank's step together: a peer late by scheduling is exposed comm too
            torch.distributed.barrier()
        slow = self.global_rank == self.slow_rank
        if self.hide_s:  # after every parameter's gradient: the buckets' collectives run during this backward
            x = _SleepInBackward.apply(x.requires_grad_(), self.hide_s)
        if slow and self.step_s:
            _sleep(self.step_s)
        out = self(x)
        if slow and self.backward_s:  # before every parameter's gradient: this rank's buckets start late
            out = _SleepInBackward.apply(out, self.backward_s)
        return nn.functional.mse_loss(out, y)


def _fit(rank: int, world: int, strategy: Any, model: _Model, steps: int = STEPS, every: int = EVERY) -> dict:
    logger = CaptureLogger()
    monitor = EfficiencyMonitor(warmup_steps=2, count_flops=False, print_summary=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world,
            strategy=strategy,
            max_steps=steps,
            log_every_n_steps=every,
            use_distributed_sampler=False,
            logger=logger,
            callbacks=[monitor],
        )
    )
    SLEPT_S.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, make_loader(make_dataset(4 * steps * world), 4, rank, world))
    summary = monitor.summary
    return {
        "slept_ms": _mean_ms(SLEPT_S),
        "summary": summary,
        "exposed_ms": summary.get("comm_exposed_frac", float("nan")) * summary["step_time_ms"],
        "rank_exposed_ms": [1e3 * r["comm_exposed_s"] / r["steps"] for r in monitor.report["ranks"]],
        "perf": [m for _, m in logger.with_prefix("perf/")],
        "stragglers": monitor.report["stragglers"],
        "warnings": [str(w.message) for w in caught if "straggler" in str(w.message)],
    }


def _delayed_and_hidden(rank: int, world: int) -> dict[str, dict]:
    def fit(hook: Any, hide_s: float = 0.0) -> dict:
        return _fit(rank, world, AccelDDP(sync_batchnorm=False, comm_hook=hook), _Model(hide_s, line_up=True))

    runs = {"plain": fit(default_hooks.allreduce_hook)}
    APPLIED_DELAYS_S.clear()
    runs["delayed"] = fit(_delayed_allreduce)
    runs["delayed"]["applied_ms"] = _mean_ms(APPLIED_DELAYS_S)
    runs["hidden"] = fit(_delayed_allreduce, hide_s=2 * DELAY_S)
    return runs


def test_exposed_comm_rises_by_a_delay_after_the_backward_and_stays_near_zero_when_the_backward_hides_it():
    runs = run_distributed(_delayed_and_hidden, 2, init_process_group=False, timeout=180)
    plain, delayed, hidden = runs[0]["plain"], runs[0]["delayed"], runs[0]["hidden"]
    # comm_exposed_frac x step time is the exposed time per step (the mean over ranks): it rises by the delay the
    # hook applied, on average over the ranks (a 30 ms timer fires a little late on a busy machine) ...
    applied_ms = sum(run["delayed"]["applied_ms"] for run in runs) / len(runs)
    assert 1e3 * DELAY_S <= applied_ms < 2e3 * DELAY_S
    rise_ms = delayed["exposed_ms"] - plain["exposed_ms"]
    assert rise_ms == pytest.approx(applied_ms, rel=0.25), (plain["exposed_ms"], delayed["exposed_ms"], applied_ms)
    assert delayed["summary"]["compute_frac"] < plain["summary"]["compute_frac"]
    # ... and not when a longer backward runs meanwhile: the same delayed hook, all of it hidden.
    assert hidden["exposed_ms"] < 0.25 * 1e3 * DELAY_S, hidden["exposed_ms"]
    assert hidden["summary"]["compute_frac"] > 0.9
    for result in (plain, delayed, hidden):
        for metrics in result["perf"]:  # logged at every logging step, from rank 0
            assert 0.0 <= metrics["perf/comm_exposed_frac"] < 1.0 and 0.0 < metrics["perf/compute_frac"] <= 1.0


def _slow_backward_everywhere(rank: int, world: int) -> dict[str, dict]:
    slow = dict(slow_rank=1, backward_s=DELAY_S)
    return {
        "accel_ddp": _fit(rank, world, AccelDDP(sync_batchnorm=False), _Model(**slow)),  # DDP's own timers
        "accel_ddp_hooked": _fit(
            rank, world, AccelDDP(sync_batchnorm=False, comm_hook=default_hooks.allreduce_hook), _Model(**slow)
        ),
        "accel_fsdp": _fit(rank, world, AccelFSDP(sync_batchnorm=False), _Model(**slow)),  # every collective blocks
    }


def test_the_wait_for_a_rank_slow_in_its_backward_is_exposed_on_the_others_and_names_it():
    """Rank 1's backward sleeps before its gradients exist: rank 0 waits that long in each step's collectives."""
    runs = run_distributed(_slow_backward_everywhere, 2, init_process_group=False, timeout=180)
    host = socket.gethostname()
    for strategy, result in runs[0].items():
        waited, slow = result["rank_exposed_ms"]
        slept = runs[1][strategy]["slept_ms"]  # rank 1's sleeps as they really lasted (30 ms asked)
        assert 1e3 * DELAY_S <= slept < 2e3 * DELAY_S
        assert waited - slow == pytest.approx(slept, rel=0.25), (strategy, waited, slow, slept)
        assert [m["perf/straggler_rank"] for m in result["perf"]] == [1.0] * len(result["perf"]), strategy
        assert len(result["perf"]) == LOGGED
        assert {r["cause"] for r in result["stragglers"]} == {"compute"}, strategy
        assert len(result["warnings"]) == 1 and f"rank 1 on host {host} is the straggler" in result["warnings"][0]


def _slow_training_step(rank: int, world: int) -> dict[str, dict]:
    slow = dict(slow_rank=world - 1, step_s=SLOW_STEP_S)
    runs = {"accel_ddp": _fit(rank, world, AccelDDP(sync_batchnorm=False), _Model(**slow))}
    if world == 2:  # Lightning's own DDP: no comm_stats, so the forward alone is each rank's compute
        runs["ddp"] = _fit(rank, world, "ddp", _Model(**slow))
    return runs


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_slow_in_its_training_step_is_named_at_every_logging_step(world):
    runs = run_distributed(_slow_training_step, world, init_process_group=False, timeout=240)
    for strategy, result in runs[0].items():
        rows = [m["perf/straggler_rank"] for m in result["perf"]]
        assert rows == [float(world - 1)] * LOGGED, (strategy, rows)
        assert {r["cause"] for r in result["stragglers"]} == {"compute"}, strategy
        # Its own time per step exceeds the others' by the sleep as it really lasted (whatever the step time on this
        # machine; one window can be off by a scheduling hiccup, the mean over the windows not).
        excess_ms = [1e3 * r["excess_s_per_step"] for r in result["stragglers"]]
        slept = runs[world - 1][strategy]["slept_ms"]
        assert sum(excess_ms) / len(excess_ms) == pytest.approx(slept, rel=0.25), (strategy, excess_ms, slept)
        assert len(result["warnings"]) == 1 and f"rank {world - 1} on host" in result["warnings"][0]


def _equal_ranks(rank: int, world: int) -> dict:
    # Every rank does the same work for 50 steps: a sleep and the tiny model. The sleep stands for a real step's
    # length: scheduling jitter on this shared machine (a few ms per step with 4 processes on 2 busy cores) would
    # be a third of a step of the tiny model alone.
    model = _Model(slow_rank=rank, step_s=EQUAL_STEP_S)
    return _fit(rank, world, AccelDDP(sync_batchnorm=False), model, steps=50, every=5)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_equal_ranks_name_no_straggler_over_a_50_step_run(world):
    result = run_distributed(_equal_ranks, world, init_process_group=False, timeout=240)[0]
    assert len(result["perf"]) == 10
    assert [m["perf/straggler_rank"] for m in result["perf"]] == [-1.0] * 10, result["stragglers"]
    assert result["warnings"] == [] and result["stragglers"] == []


def test_the_per_bucket_bookkeeping_does_no_tensor_work_and_counts_from_the_end_of_the_compute():
    """HookCommStats' per-bucket path, driven as DDP drives it: a bucket handed over inside a backward that goes on."""
    from lit_accel.strategies.parts._comm_stats import HookCommStats

    stats, cpu = HookCommStats(), torch.device("cpu")
    recorder = OpRecorder()
    rounds: list[Any] = []

    class _HandOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            with recorder:
                rounds.append((stats.start(cpu), stats.open_round(cpu)))  # as the counting hook does, per bucket
            return grad

    x = torch.randn(3, requires_grad=True)
    _SleepInBackward.apply(_HandOver.apply(x), 0.0).sum().backward()  # the bucket's hand-off, mid-backward
    _HandOver.apply(_SleepInBackward.apply(x, 0.02)).sum().backward()  # ... then 20 ms more compute: hidden
    time.sleep(0.01)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)
    with recorder:
        for start, round_ in rounds:
            stats.finish(start, done, round_)  # both collectives complete now, 10 ms after the second compute
        exposed = stats.pop_exposed_s()
    assert recorder.ops == []
    # Round 1 ended its compute long before (> 10 ms exposed); round 2 >= 10 ms but not its 20 ms of compute.
    assert 0.02 <= exposed < 0.2, exposed
    assert stats.pop_exposed_s() == 0.0  # popped


class _SampledRounds(pl.Callback):
    """After every batch, before the monitor's hook: the rounds counted and DDP's latest sample, as pops see them."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, Any]] = []
        self.comm_hook: object = "not read"

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from lit_accel.utilities._compat import ddp_sampled_round

        self.reads.append((trainer.strategy.comm_stats.rounds, ddp_sampled_round(trainer.strategy.model)))

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from lit_accel.utilities._compat import ddp_logging_data

        self.comm_hook = ddp_logging_data(trainer.strategy.model).get("comm_hook")  # DDP names a registered hook


def _estimated_and_exact(rank: int, world: int) -> dict[str, dict]:
    runs = {}
    for exact in (False, True):
        recorder, logger = _SampledRounds(), CaptureLogger()
        monitor = EfficiencyMonitor(warmup_steps=2, count_flops=False, print_summary=False, exact_comm_timing=exact)
        kwargs = dict(max_steps=STEPS, log_every_n_steps=EVERY, use_distributed_sampler=False, logger=logger)
        trainer = pl.Trainer(**small_trainer_kwargs(devices=world, strategy=AccelDDP(sync_batchnorm=False), **kwargs,
                                                    callbacks=[recorder, monitor]))  # fmt: skip
        model = _Model()
        trainer.fit(model, make_loader(make_dataset(4 * STEPS * world), 4, rank, world))
        # The pops: when the window opens (the end of the warm-up, step 1), then at each logging step.
        pops = [recorder.reads[step] for step in (1, *range(EVERY - 1, STEPS, EVERY))]
        expected = [0.0, 0.0]  # this rank's comm and exposed seconds: rounds since the last pop x the latest sample
        for (before, _), (rounds, sample) in itertools.pairwise(pops):
            expected[0] += (rounds - before) * sample[1]
            expected[1] += (rounds - before) * max(0.0, sample[1] - sample[2])
        runs["exact" if exact else "estimated"] = {
            "comm_hook": recorder.comm_hook,
            "sampled_at_last_pop": pops[-1][1][0],
            "expected": expected,
            "ranks": monitor.report["ranks"],
            "summary": monitor.summary,
            "perf": [m for _, m in logger.with_prefix("perf/")],
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
    return runs


def test_default_monitor_estimates_ddp_comm_time_from_ddps_own_samples_without_a_hook():
    """No Python comm hook by default: the bytes exact, the time DDP's sampled rounds; the hook only when asked."""
    runs = run_distributed(_estimated_and_exact, 2, init_process_group=False, timeout=180)
    for rank, result in enumerate(runs):
        estimated, exact = result["estimated"], result["exact"]
        assert estimated["comm_hook"] is None  # DDP's C++ all-reduce ran: no hook was ever registered
        assert exact["comm_hook"] == "accel_counting_hook(allreduce_hook)"
        # AccelDDP had DDP sample every log_every_n_steps (4) rounds: after 16 rounds, round 12 (torch's rate: 10).
        assert estimated["sampled_at_last_pop"] == 12
        # This rank's communication time and its exposed part, summed over the windows (rank 0's gathered report),
        # are the formula over DDP's own samples as this rank read them at each pop.
        row = runs[0]["estimated"]["ranks"][rank]
        assert row["comm_s"] == pytest.approx(estimated["expected"][0], rel=1e-9) and row["comm_s"] > 0
        assert row["comm_exposed_s"] == pytest.approx(estimated["expected"][1], rel=1e-9)
    estimated, exact = runs[0]["estimated"], runs[0]["exact"]
    rows = estimated["ranks"]
    frac = sum(min(1.0, r["comm_s"] / r["window_s"]) for r in rows) / len(rows)
    assert estimated["summary"]["comm_time_frac"] == pytest.approx(frac, rel=1e-9)
    for result in (estimated, exact):  # logged at every logging step; the bytes the same exact count either way
        assert len(result["perf"]) == LOGGED
        for metrics in result["perf"]:
            assert metrics["perf/comm_gb_per_step"] * 1e9 == pytest.approx(result["grad_bytes"], rel=1e-9)
            assert 0.0 < metrics["perf/comm_time_frac"] <= 1.0  # an estimate from an earlier round is capped
