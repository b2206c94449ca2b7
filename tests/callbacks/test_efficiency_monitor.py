import csv
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lit_accel import EfficiencyMonitor
from lit_accel.utilities._timing import IntervalTimer, synchronize
from tests.helpers import BNModel, CaptureLogger, make_dataset, make_loader, run_distributed, small_trainer_kwargs
from tests.helpers.dispatch import OpRecorder

# BNModel(batchnorm=False) is Linear(8, 16) -> ReLU -> Linear(16, 4). Training FLOPs per sample (2 per MAC): forward
# 2*(8*16 + 16*4), weight gradients the same again, input gradient of the second layer only 2*16*4.
MLP_FLOPS_PER_SAMPLE = 2 * (8 * 16 + 16 * 4) * 2 + 2 * 16 * 4


class _FakeClock:
    """A clock the model advances by exact binary fractions, so window arithmetic is exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _TimedModel(BNModel):
    """Each micro-batch costs DATA s between batches, FORWARD s in training_step and BACKWARD s after backward."""

    DATA, FORWARD, BACKWARD, VALIDATION = 0.25, 0.5, 0.25, 8.0

    def __init__(self, clock: _FakeClock) -> None:
        super().__init__(batchnorm=False)
        self.clock = clock

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.clock.now += self.DATA  # runs after the fetch, before on_train_batch_start: data wait
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += self.FORWARD
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        self.clock.now += self.BACKWARD

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.clock.now += self.VALIDATION  # must not count anywhere


def test_window_arithmetic_under_accumulation_4_is_exact(tmp_path):
    """10 micro-batches of 4 samples, accumulation 4 -> optimizer steps of 4, 4 and 2 micro-batches.

    Step 1 is warm-up (and the FLOP-counting step). Each micro-batch costs 0.25 + 0.5 + 0.25 = 1 s, of which 0.25 s
    data wait; a validation run (8 s + 0.25 s data) sits in the middle of step 2's window and must be excluded.
    """
    clock = _FakeClock()
    capture = CaptureLogger()
    monitor = EfficiencyMonitor(
        warmup_steps=1,
        clock=clock,
        items_fn=lambda batch: 3 * len(batch[0]),
        peak_flops=1e5,
        report_path=tmp_path / "report.json",
        print_summary=False,
    )
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            max_steps=-1,
            max_epochs=1,
            accumulate_grad_batches=4,
            log_every_n_steps=1,
            logger=capture,
            callbacks=[monitor],
            limit_val_batches=1,
            val_check_interval=6,  # after micro-batch 6, inside step 2's window
        )
    )
    trainer.fit(_TimedModel(clock), make_loader(make_dataset(40), 4), make_loader(make_dataset(8), 4))
    assert trainer.global_step == 3

    assert monitor.flops_per_sample == MLP_FLOPS_PER_SAMPLE
    perf = capture.with_prefix("perf/")
    # Steps 2 and 3 are logged, at the step value Lightning uses for their training_step metrics (1 and 2).
    assert [step for step, _ in perf] == [1, 2]
    first, tail = perf[0][1], perf[1][1]
    # Step 2: 4 micro-batches x 1 s, 16 samples, 4 s of data wait.
    assert first["perf/step_time_ms"] == 4000.0
    assert first["perf/samples_per_sec"] == 16 / 4.0
    assert first["perf/samples_per_sec_per_device"] == 16 / 4.0
    assert first["perf/data_wait_frac"] == 1.0 / 4.0
    assert first["perf/items_per_sec"] == 3 * 16 / 4.0
    assert first["perf/tflops_per_device"] == MLP_FLOPS_PER_SAMPLE * 16 / 4.0 / 1e12
    assert first["perf/mfu"] == MLP_FLOPS_PER_SAMPLE * 16 / 4.0 / 1e5
    # Step 3 is the epoch's short last window: 2 micro-batches.
    assert tail["perf/step_time_ms"] == 2000.0
    assert tail["perf/samples_per_sec"] == 8 / 2.0
    assert tail["perf/data_wait_frac"] == 0.5 / 2.0
    # No GPU, one process: no memory, spread or communication keys.
    assert not {"perf/peak_memory_gb", "perf/step_time_spread", "perf/comm_gb_per_step"} & set(first)

    # Averages over the measured steps only (warm-up excluded): 24 samples in 6 s over 2 optimizer steps.
    s = monitor.summary
    assert s["measured_steps"] == 2
    assert s["step_time_ms"] == 6000.0 / 2
    assert s["samples_per_sec"] == 24 / 6.0
    assert s["items_per_sec"] == 72 / 6.0
    assert s["data_wait_frac"] == 1.5 / 6.0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["averages"] == s
    assert report["config"] == {
        "device": "cpu",
        "precision": "fp32",
        "world_size": 1,
        "peak_flops": 1e5,
        "flops_per_sample": MLP_FLOPS_PER_SAMPLE,
        "flops_by_dtype": {"fp32": MLP_FLOPS_PER_SAMPLE},  # FlopCounterMode's count, all of it fp32 on CPU
        "peak_entry": None,
        "peak_reason": "given as peak_flops",
        "warmup_steps": 1,
        "accumulate_grad_batches": 4,
        "baseline_samples_per_sec": None,
        "straggler_threshold": 0.2,
        "comm_note": None,  # one process: no communication to explain
    }
    assert [w["step"] for w in report["windows"]] == [1, 2]


def test_scaling_efficiency_and_the_tail_flushed_at_the_end(tmp_path):
    """log_every_n_steps=3 with 4 measured steps: one logged window, then the unlogged tail is flushed at the end.

    The batch size comes back as a tensor here, the path for user functions that count on device.
    """
    clock = _FakeClock()
    capture = CaptureLogger()
    monitor = EfficiencyMonitor(
        warmup_steps=1,
        clock=clock,
        count_flops=False,
        baseline_samples_per_sec=8.0,
        print_summary=False,
        batch_size_fn=lambda batch: torch.tensor(batch[0].shape[0]),  # a tensor: summed, read at logging steps
    )
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=5, log_every_n_steps=3, logger=capture, callbacks=[monitor]))
    trainer.fit(_TimedModel(clock), make_loader(make_dataset(40), 4))
    perf = capture.with_prefix("perf/")
    assert [step for step, _ in perf] == [2, 4]  # steps 2-3 at the cadence, steps 4-5 at the end of fit
    for _, metrics in perf:
        assert metrics["perf/step_time_ms"] == 1000.0
        assert metrics["perf/samples_per_sec"] == 4 / 1.0
        assert metrics["perf/scaling_efficiency"] == (4 / 1.0) / 8.0
        assert "perf/tflops_per_device" not in metrics  # count_flops=False and no flops_per_sample
    assert monitor.summary["measured_steps"] == 4


def _fit_cpu(tmp_path: Path, monitor: EfficiencyMonitor, precision: str = "32-true") -> list[dict[str, str]]:
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            max_steps=3, log_every_n_steps=1, logger=CSVLogger(tmp_path), callbacks=[monitor], precision=precision
        )
    )
    trainer.fit(BNModel(batchnorm=False), make_loader(make_dataset(32), 4))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _perf_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in rows if r.get("perf/samples_per_sec")]


def test_a_cpu_run_logs_no_mfu_and_no_line(tmp_path, caplog):
    """A CPU has no datasheet peak: no MFU is expected there, so nothing is printed about it (issue #51)."""
    monitor = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        rows = _perf_rows(_fit_cpu(tmp_path, monitor))
    assert [r.getMessage() for r in caplog.records if "EfficiencyMonitor" in r.getMessage()] == []
    assert rows and all(r["perf/tflops_per_device"] for r in rows)
    assert "perf/mfu" not in rows[0]
    assert "cpu" in monitor.report["config"]["peak_reason"]


def test_an_unknown_accelerator_gets_one_info_line_asking_for_its_peak(caplog):
    from types import SimpleNamespace

    # setup() reads only the device and the precision: a device no table knows stands for a card not in it
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta")), precision="bf16-mixed")
    monitor = EfficiencyMonitor(print_summary=False)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        monitor.setup(trainer, None, "fit")
        monitor.setup(trainer, None, "fit")  # a second fit: said once per monitor
    lines = [r.getMessage() for r in caplog.records if "EfficiencyMonitor" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "no peak FLOP/s known for 'meta'" in lines[0] and "Fix: pass EfficiencyMonitor(peak_flops=" in lines[0]


def test_mfu_above_100_percent_is_refused_with_one_warning(tmp_path):
    with pytest.warns(UserWarning, match="MFU is not reported: MFU would be") as record:
        rows = _perf_rows(_fit_cpu(tmp_path, EfficiencyMonitor(warmup_steps=1, peak_flops=1.0, print_summary=False)))
    assert len([w for w in record if "MFU would be" in str(w.message)]) == 1
    assert len(rows) == 2 and "perf/mfu" not in rows[0]


def test_mfu_is_tflops_over_the_given_peak_at_the_runs_precision(tmp_path):
    peak = 1e15
    monitor = EfficiencyMonitor(warmup_steps=1, peak_flops=peak, print_summary=False)
    rows = _perf_rows(_fit_cpu(tmp_path, monitor, precision="bf16-mixed"))
    assert len(rows) == 2
    for r in rows:
        assert float(r["perf/mfu"]) == pytest.approx(float(r["perf/tflops_per_device"]) * 1e12 / peak, rel=1e-12)
    assert monitor.report["config"]["precision"] == "bf16"
    assert monitor.report["config"]["peak_flops"] == peak


def test_a_fit_that_is_all_warm_up_measures_nothing_and_says_so(caplog):
    monitor = EfficiencyMonitor(warmup_steps=5, print_summary=False)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=3, callbacks=[monitor]))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer.fit(BNModel(), make_loader(make_dataset(32), 4))
    assert monitor.summary == {}
    assert any("all of them warm-up (5)" in r.getMessage() for r in caplog.records)


class _ProbedMonitor(EfficiencyMonitor):
    """Records every tensor op that the per-step hooks dispatch, and whether the call was a logging step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, bool, list[str]]] = []
        self.windows_closed = 0
        self._step_at_start = 0

    def _probe(self, name: str, trainer: pl.Trainer, *args: Any) -> None:
        if name == "on_train_batch_start":
            self._step_at_start = trainer.global_step
        with OpRecorder() as rec:
            getattr(super(), name)(trainer, *args)
        stepped = trainer.global_step > self._step_at_start
        logging_step = name == "on_train_batch_end" and stepped and trainer.global_step % 4 == 0
        self.calls.append((name, logging_step, rec.ops))

    def on_train_batch_start(self, trainer, *args):
        self._probe("on_train_batch_start", trainer, *args)

    def on_before_backward(self, trainer, *args):
        self._probe("on_before_backward", trainer, *args)

    def on_after_backward(self, trainer, *args):
        self._probe("on_after_backward", trainer, *args)

    def on_train_batch_end(self, trainer, *args):
        self._probe("on_train_batch_end", trainer, *args)

    def on_train_start(self, trainer, *args):
        super().on_train_start(trainer, *args)
        compute = self.meter.compute

        def counted(*a: Any, **kw: Any) -> Any:
            self.windows_closed += 1
            return compute(*a, **kw)

        self.meter.compute = counted


def test_per_step_hooks_do_no_tensor_work_outside_logging_steps():
    """Nothing in the per-step path touches a tensor (so no .item(), no sync); logging steps do (the gather)."""
    monitor = _ProbedMonitor(warmup_steps=1, flops_per_sample=1.0, print_summary=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            max_steps=9, accumulate_grad_batches=2, log_every_n_steps=4, logger=CaptureLogger(), callbacks=[monitor]
        )
    )
    trainer.fit(BNModel(), make_loader(make_dataset(96), 4))
    logging_calls = [c for c in monitor.calls if c[1]]
    # Windows close at steps 4 and 8 (the cadence) and once at the end of fit (step 9).
    assert monitor.windows_closed == 3
    assert len(logging_calls) == 2 and all(ops for *_, ops in logging_calls)  # the probe does see tensor ops
    quiet = [c for c in monitor.calls if c not in logging_calls]
    assert len(quiet) == 4 * 18 - 2  # four hooks on each of the 18 micro-batches
    assert [c for c in quiet if c[2]] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1\): expected an int >= 0\. Fix"),
        ({"warmup_steps": 1.5}, TypeError, r"warmup_steps=1.5\): expected an int"),
        ({"warmup_steps": True}, TypeError, r"warmup_steps=True\)"),
        ({"peak_flops": 0}, ValueError, r"peak_flops=0\): expected a finite number > 0 or None.*datasheet table"),
        ({"peak_flops": -3e12}, ValueError, r"peak_flops=-3000000000000.0\)"),
        ({"peak_flops": float("inf")}, ValueError, r"peak_flops=inf\)"),
        ({"flops_per_sample": 0.0}, ValueError, r"flops_per_sample=0.0\).*count FLOPs automatically"),
        ({"baseline_samples_per_sec": -1}, ValueError, r"baseline_samples_per_sec=-1\).*one-device run"),
        ({"batch_size_fn": 4}, TypeError, r"batch_size_fn=4\): expected a callable"),
        ({"items_fn": "tokens"}, TypeError, r"items_fn='tokens'\): expected a callable"),
        ({"exact_comm_timing": "yes"}, TypeError, r"exact_comm_timing='yes'\): expected True or False\. Fix"),
    ],
)
def test_bad_arguments_are_rejected_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=r"EfficiencyMonitor\(" + match):
        EfficiencyMonitor(**kwargs)


class _LossLoggingModel(BNModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


WORLD, MICRO_BATCH, ACCUMULATE, STEPS = 2, 4, 2, 6


def _fit_ddp_with_monitor(rank: int, world_size: int, log_dir: str, strategy_name: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    torch.manual_seed(0)
    if strategy_name.startswith("accel_ddp"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from lit_accel import AccelDDP

        # The default registers no comm hook (DDP's own all-reduce; numbers from DDP's logging); "_hooked" times every
        # all-reduce through AccelDDP's counting wrapper around torch's plain all-reduce hook.
        hook = default_hooks.allreduce_hook if strategy_name == "accel_ddp_hooked" else None
        strategy: Any = AccelDDP(comm_hook=hook)
    else:
        strategy = DDPStrategy()
    monitor = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            strategy=strategy,
            max_steps=STEPS,
            accumulate_grad_batches=ACCUMULATE,
            log_every_n_steps=1,
            use_distributed_sampler=False,
            logger=CSVLogger(log_dir),
            callbacks=[monitor],
        )
    )
    n = world_size * MICRO_BATCH * ACCUMULATE * STEPS
    model = _LossLoggingModel(batchnorm=False)
    trainer.fit(model, make_loader(make_dataset(n), MICRO_BATCH, rank, world_size))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"summary": monitor.summary, "grad_bytes": grad_bytes, "comm_note": monitor.report["config"]["comm_note"]}


def _check_ddp_run(tmp_path: Path, strategy_name: str) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    results = run_distributed(
        _fit_ddp_with_monitor, WORLD, str(tmp_path), strategy_name, init_process_group=False, timeout=120
    )
    files = list(tmp_path.rglob("metrics.csv"))
    assert len(files) == 1  # rank 0 logs; rank 1's logger writes nothing
    with open(files[0]) as f:
        rows = list(csv.DictReader(f))
    perf = _perf_rows(rows)
    assert [int(r["step"]) for r in perf] == list(range(1, STEPS))  # steps 2..6, labelled as Lightning does
    # ... and each perf row lines up with Lightning's own train_loss rows of the same optimizer step.
    loss_steps = {int(r["step"]) for r in rows if r.get("train_loss")}
    assert {int(r["step"]) for r in perf} <= loss_steps
    global_batch = WORLD * ACCUMULATE * MICRO_BATCH
    for r in perf:
        samples_per_sec, step_s = float(r["perf/samples_per_sec"]), float(r["perf/step_time_ms"]) / 1e3
        # Both come from the same window (the slowest rank's wall-clock), so the product is the global batch up to
        # float rounding, whatever the timing noise; a per-rank count or micro-batches counted as steps would not.
        assert samples_per_sec * step_s == pytest.approx(global_batch, rel=1e-9)
        assert float(r["perf/samples_per_sec_per_device"]) == pytest.approx(samples_per_sec / WORLD, rel=1e-12)
        assert float(r["perf/step_time_spread"]) >= 1.0
        assert 0.0 <= float(r["perf/data_wait_frac"]) < 1.0
    # Every rank derives the same averages from the same gathered numbers.
    assert results[0]["summary"] == results[1]["summary"]
    assert results[0]["summary"]["measured_steps"] == STEPS - 1
    return perf, results


def test_two_process_ddp_with_accumulation_2(tmp_path):
    perf, results = _check_ddp_run(tmp_path, "ddp")
    assert "perf/comm_gb_per_step" not in perf[0] or not perf[0]["perf/comm_gb_per_step"]
    # the report (and the table drawn from it) says why: Lightning's DDPStrategy counts no collectives
    assert results[0]["comm_note"].startswith("not measured: DDPStrategy counts no collectives")


@pytest.mark.parametrize("strategy_name", ["accel_ddp", "accel_ddp_hooked"])
def test_two_process_accel_ddp_reports_all_reduce_volume(tmp_path, strategy_name):
    perf, results = _check_ddp_run(tmp_path, strategy_name)
    assert results[0]["comm_note"] is None  # AccelDDP counts its all-reduces: nothing to explain
    # DDP all-reduces every gradient once per optimizer step: bytes per step = the parameters' bytes. Without a hook
    # the time is DDP's sampled per-round time x rounds; with one it is measured: both are a share of the window.
    for r in perf:
        assert float(r["perf/comm_gb_per_step"]) * 1e9 == pytest.approx(results[0]["grad_bytes"], rel=1e-9)
        busbw = float(r["perf/comm_busbw_gbps"])
        assert busbw > 0 and math.isfinite(busbw)
        assert 0.0 < float(r["perf/comm_time_frac"]) < 1.0


def test_validate_outside_fit_leaves_the_monitor_untouched():
    """validate() outside fit must not touch the monitor's training state."""
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = pl.Trainer(**small_trainer_kwargs(callbacks=[monitor], limit_val_batches=2))
    trainer.validate(BNModel(), make_loader(make_dataset(16), 4))
    assert monitor.summary == {}


def test_flops_are_counted_on_the_real_first_step_without_extra_work():
    """The count comes from the first training micro-batch: the model sees no extra forward."""

    class _Counting(BNModel):
        forwards = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            type(self).forwards += 1
            return super().forward(x)

    monitor = EfficiencyMonitor(warmup_steps=0, print_summary=False)
    model = _Counting(batchnorm=False)
    model.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=3, callbacks=[monitor]))
    trainer.fit(model, make_loader(make_dataset(32), 4))
    assert _Counting.forwards == 3
    assert monitor.flops_per_sample == MLP_FLOPS_PER_SAMPLE
    assert monitor.summary["measured_steps"] == 2  # warm-up is raised to 1: the counting step is not measured


class _SlowOnRankOne(BNModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            time.sleep(STRAGGLER_DELAY_S)
        return super().training_step(batch, batch_idx)


STRAGGLER_DELAY_S = 0.03


def _fit_with_straggler(rank: int, world_size: int, accumulate: int) -> dict[str, float]:
    monitor = EfficiencyMonitor(warmup_steps=1, count_flops=False, print_summary=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            strategy="ddp",
            max_steps=5,
            accumulate_grad_batches=accumulate,
            use_distributed_sampler=False,
            callbacks=[monitor],
        )
    )
    trainer.fit(_SlowOnRankOne(batchnorm=False), make_loader(make_dataset(160), 4, rank, world_size))
    return monitor.summary


def test_a_slow_rank_shows_in_the_spread_while_step_time_is_shared():
    """Rank 1 sleeps 30 ms in every forward. DDP's all-reduce makes both ranks' windows equal, so only the busy time
    (data wait + forward) tells them apart: rank 1's is >= 30 ms per micro-batch, rank 0's a few ms on this model."""
    summary = run_distributed(_fit_with_straggler, 2, 1, init_process_group=False, timeout=120)[0]
    assert summary["step_time_ms"] >= 1e3 * STRAGGLER_DELAY_S
    assert summary["step_time_spread"] > 3.0


def test_interval_timer_sums_host_intervals_on_cpu():
    clock = _FakeClock()
    timer = IntervalTimer(torch.device("cpu"), clock)
    timer.stop()  # no open interval: ignored
    for length in (0.5, 0.25):
        timer.start()
        clock.now += length
        timer.stop()
        clock.now += 10.0  # outside any interval
    assert timer.pop_total_s() == 0.75
    assert timer.pop_total_s() == 0.0  # popped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_interval_timer_times_device_work_with_events_on_cuda():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    timer = IntervalTimer(device, time.perf_counter)
    torch.cuda.synchronize()
    start = time.perf_counter()
    timer.start()
    for _ in range(20):
        a = a @ a / 64.0
    timer.stop()  # the host returns long before the device finishes
    synchronize(device)
    wall = time.perf_counter() - start
    events = timer.pop_total_s()
    assert 0.5 * wall <= events <= wall * 1.01
