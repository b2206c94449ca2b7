"""The monitors read only ``lit_accel.protocols``: a third-party strategy and precision plugin feed them.

``_CountingDDP`` is Lightning's own ``DDPStrategy`` plus a ``comm_stats`` property; ``_StaticScalePrecision`` is a
plain Lightning ``Precision`` that scales the loss by a fixed factor and keeps its own device counters. Neither uses
any lit_accel class, yet both monitors report what they count, on 2 real gloo processes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from lit_accel import EfficiencyMonitor, LossScaleMonitor
from lit_accel.protocols import (
    CommStats,
    CommStatsProvider,
    CommTiming,
    ExposedComm,
    ScalerStats,
    ScalerStatsProvider,
    SkippedStepRecord,
)
from tests.helpers import BNModel, CaptureLogger, make_dataset, make_loader, run_distributed, small_trainer_kwargs

SCALE, BAD_STEP, STEPS = 2.0**10, 3, 6


class _Counter:
    """The CommStats protocol: collectives and bytes, counted by the strategy's own hook."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def pop_elapsed_s(self) -> float:
        return 0.0


class _CountingDDP(DDPStrategy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._counter = _Counter()

    @property
    def comm_stats(self) -> _Counter:
        return self._counter

    def configure_ddp(self) -> None:
        super().configure_ddp()
        counter = self._counter

        def hook(state, bucket):
            counter.calls += 1
            counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
            work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        self.model.register_comm_hook(None, hook)


class _StaticScalePrecision(Precision):
    """Scale the loss by SCALE, unscale, skip non-finite steps; counters on the device (the ScalerStats protocol)."""

    precision = "32-true"

    def __init__(self) -> None:
        self._skipped = torch.zeros((), dtype=torch.int64)
        self._last_skipped = False

    @property
    def loss_scaling(self) -> bool:
        return True

    def scaler_stats(self) -> ScalerStats:
        zero = torch.zeros((), dtype=torch.int64)
        return ScalerStats(torch.tensor(SCALE), zero, zero, self._skipped.clone(), zero, zero)

    def step_was_skipped(self, optimizer: Any = None) -> bool:
        return self._last_skipped

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        return super().pre_backward(tensor * SCALE, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        closure()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch._foreach_div_(grads, SCALE)
        self._last_skipped = not all(torch.isfinite(g).all() for g in grads)  # a test plugin may sync
        self._skipped += int(self._last_skipped)
        return None if self._last_skipped else optimizer.step(**kwargs)


class _Model(BNModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == BAD_STEP else loss


def _run(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    strategy, precision = _CountingDDP(), _StaticScalePrecision()
    assert isinstance(strategy, CommStatsProvider) and isinstance(strategy.comm_stats, CommStats)
    assert not isinstance(strategy.comm_stats, ExposedComm)  # the optional protocol: left out here
    assert isinstance(precision, ScalerStatsProvider) and isinstance(precision, SkippedStepRecord)
    logger = CaptureLogger()
    efficiency = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    scale = LossScaleMonitor(logging_interval=1)
    model = _Model(batchnorm=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            max_steps=STEPS,
            log_every_n_steps=1,
            logger=logger,
            strategy=strategy,
            plugins=[precision],
            callbacks=[efficiency, scale],
            use_distributed_sampler=False,
        )
    )
    trainer.fit(model, make_loader(make_dataset(64), 4, rank, world_size))
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "scale_rows": logger.with_prefix("amp/"),
        "perf_rows": logger.with_prefix("perf/"),
        "last": scale.last_metrics,
        "summary": efficiency.summary,
        "gradient_bytes": gradient_bytes,
        "calls": strategy.comm_stats.calls,
    }


def test_a_third_party_strategy_and_precision_feed_both_monitors():
    results = run_distributed(_run, 2, init_process_group=False, timeout=180)
    for rank, result in enumerate(results):
        assert result["calls"] == STEPS  # one bucket per step: the tiny model fits one bucket
        last = result["last"]
        assert last["amp/loss_scale"] == SCALE and last["amp/skipped_steps"] == 1
        assert result["summary"]["comm_gb_per_step"] == result["gradient_bytes"] / 1e9
        if rank == 0:  # Lightning's loggers write on rank 0
            skipped = [metrics["amp/skipped_steps"] for _, metrics in result["scale_rows"]]
            assert skipped == [0, 0, 0, 1, 1, 1]  # the non-finite step 3, counted by the plugin, seen by the monitor
            assert all("perf/comm_gb_per_step" in m for _, m in result["perf_rows"])
            # Without ExposedComm: no exposed-communication keys, but the straggler figures all the same.
            assert not any("perf/comm_exposed_frac" in m or "perf/compute_frac" in m for _, m in result["perf_rows"])
            assert all(m["perf/straggler_rank"] in (-1.0, 0.0, 1.0) for _, m in result["perf_rows"])


class _ExposedCounter(_Counter):
    def pop_exposed_s(self) -> float:
        return 0.0


def test_exposed_comm_is_an_optional_protocol_on_top_of_comm_stats():
    counter = _ExposedCounter()
    assert isinstance(counter, CommStats) and isinstance(counter, ExposedComm)
    assert not isinstance(_Counter(), ExposedComm)


class _TimedOnRequest(_Counter):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def request_timing(self) -> None:
        self.requests += 1


def test_comm_timing_is_optional_and_the_efficiency_meter_asks_for_it_only_with_exact_comm_timing():
    from lit_accel import EfficiencyMeter
    from lit_accel.strategies.parts._comm_stats import HookCommStats

    assert isinstance(HookCommStats(), CommTiming) and not isinstance(_Counter(), CommTiming)
    counter = _TimedOnRequest()
    EfficiencyMeter("cpu", world_size=1, comm_stats=counter)  # by default the strategy's own (cheaper) timing
    assert counter.requests == 0
    EfficiencyMeter("cpu", world_size=1, comm_stats=counter, exact_comm_timing=True)
    EfficiencyMeter("cpu", world_size=1, comm_stats=_Counter(), exact_comm_timing=True)  # without it is fine
    assert counter.requests == 1
