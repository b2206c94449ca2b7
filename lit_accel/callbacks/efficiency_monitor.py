"""``EfficiencyMonitor``: the Lightning adapter of :class:`~lit_accel.meters.EfficiencyMeter`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lit_accel.callbacks._flops import FlopCounter
from lit_accel.meters.efficiency import EfficiencyMeter, checked_peak_flops
from lit_accel.meters.plots import efficiency_figure, save_report
from lit_accel.meters.tables import comm_note, efficiency_table, peaks_caption
from lit_accel.protocols import CommStatsProvider, PipelineBubbleStats
from lit_accel.utilities._compat import batches_that_stepped
from lit_accel.utilities._idle_hooks import idle, idle_unused, wake
from lit_accel.utilities._peak_flops import PeakLookup, cuda_device_facts, lookup_peaks, matmul_precision
from lit_accel.utilities._validation import check_bool, check_int, check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EfficiencyMonitor"]


class EfficiencyMonitor(Callback):
    """Log throughput, step-time breakdown, TFLOP/s, MFU, stragglers and all-reduce volume, with no per-step sync.

    Works with any strategy (the communication figures with any whose ``comm_stats`` follows
    :class:`lit_accel.protocols.CommStats`). Logs from rank 0 at the Trainer's ``log_every_n_steps`` cadence, at the
    step of that optimizer step's own metrics; at the end of fit prints a table and writes ``report_path`` (JSON, and
    a PNG beside it). FLOPs are counted once by ``FlopCounterMode`` over the first real training micro-batch, by the
    dtype they ran in, unless ``flops_per_sample`` is given. Keys (after ``log_key_prefix``): ``samples_per_sec``,
    ``samples_per_sec_per_device``, ``items_per_sec`` (with ``items_fn``), ``step_time_ms``, ``data_wait_frac``,
    ``tflops_per_device``, ``mfu``, ``peak_memory_gb`` (CUDA), ``step_time_spread``, ``scaling_efficiency``,
    ``comm_gb_per_step``, ``comm_busbw_gbps``, ``comm_time_frac``, ``comm_exposed_frac``, ``compute_frac``,
    ``straggler_rank``, ``straggler_excess_frac``, ``recompiles``; formulas in ``docs/monitors.md``.

    Args:
        warmup_steps: optimizer steps not measured (at least 1 while FLOPs are counted).
        batch_size_fn: ``batch -> samples`` of a micro-batch (default: Lightning's ``extract_batch_size``).
        items_fn: ``batch -> items`` (e.g. tokens), enabling ``items_per_sec``.
        flops_per_sample: training FLOPs per sample; skips automatic counting.
        count_flops: count FLOPs automatically when ``flops_per_sample`` is not given.
        peak_flops: dense peak FLOP/s of one device, or a dict by dtype (``{"bf16": ..., "fp32": ...}``), overriding
            the table (needed for MFU on CPU).
        baseline_samples_per_sec: throughput of a one-device run, enabling ``scaling_efficiency``.
        straggler_threshold, straggler_windows: name a rank whose own time exceeds the others' median by more than
            this share; warn after this many windows in a row. max_recompiles: warn above this many recompilations.
        exact_comm_timing: time every gradient collective (AccelDDP: a Python comm hook per bucket, which costs host
            time every step) instead of estimating ``comm_time_frac``/``comm_exposed_frac`` from the rounds DDP times
            itself every ``log_every_n_steps`` (``docs/monitors.md``). Strategies that always time (AccelFSDP,
            AccelParallel, a user's comm hook) are unaffected.
        report_path: where rank 0 writes the JSON report (``None``: no file). print_summary: print the table.
        log_key_prefix: prefix of every key. clock: host clock in seconds (injectable for tests).

    Raises:
        ValueError: a non-positive number or a negative ``warmup_steps``. TypeError: a non-callable function.

    Example::

        monitor = EfficiencyMonitor(report_path="efficiency.json")
        trainer = Trainer(accelerator="gpu", devices=8, precision="bf16-mixed", callbacks=[monitor])
        trainer.fit(model, datamodule=dm)
        print(monitor.summary.get("mfu"))
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 3,
        batch_size_fn: Callable[[Any], int | float | Tensor] | None = None,
        items_fn: Callable[[Any], int | float | Tensor] | None = None,
        flops_per_sample: float | None = None,
        count_flops: bool = True,
        peak_flops: float | Mapping[str, float] | None = None,
        baseline_samples_per_sec: float | None = None,
        straggler_threshold: float = 0.2,
        straggler_windows: int = 3,
        max_recompiles: int | None = 8,
        exact_comm_timing: bool = False,
        report_path: str | os.PathLike[str] | None = None,
        print_summary: bool = True,
        log_key_prefix: str = "perf/",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        name = "EfficiencyMonitor"
        check_int(name, "warmup_steps", warmup_steps, minimum=0, example=3)
        for arg, value, fix in (
            ("flops_per_sample", flops_per_sample, "omit it to count FLOPs automatically"),
            ("baseline_samples_per_sec", baseline_samples_per_sec, "pass the samples/s of a one-device run"),
        ):
            check_number(name, arg, value, allow_none=True, fix=fix)
        fix = "omit it to use the datasheet table, e.g. 989.5e12 for an H100 SXM at bf16"
        self.peak_flops = checked_peak_flops(name, peak_flops, fix)
        check_number(name, "straggler_threshold", straggler_threshold, fix="pass a share such as 0.2 (20% slower)")
        check_int(name, "straggler_windows", straggler_windows, example=3)
        check_int(name, "max_recompiles", max_recompiles, minimum=0, allow_none=True, example=8)
        self.straggler_threshold, self.straggler_windows = float(straggler_threshold), straggler_windows
        self.max_recompiles = max_recompiles
        check_bool(name, "exact_comm_timing", exact_comm_timing)
        self.exact_comm_timing = exact_comm_timing
        for name, fn in (("batch_size_fn", batch_size_fn), ("items_fn", items_fn), ("clock", clock)):
            if fn is not None and not callable(fn):
                raise TypeError(f"EfficiencyMonitor({name}={fn!r}): expected a callable or None.")
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.items_fn = items_fn
        self._flops_per_sample = None if flops_per_sample is None else float(flops_per_sample)
        self.count_flops = count_flops
        self.baseline_samples_per_sec = baseline_samples_per_sec
        self.report_path = None if report_path is None else Path(report_path)
        self.print_summary = print_summary
        self.log_key_prefix = log_key_prefix
        self._clock = clock
        #: Averages over the measured windows, on every rank, after fit.
        self.summary: dict[str, float] = {}
        #: The JSON report, on every rank, after fit.
        self.report: dict[str, Any] = {}
        self.meter: EfficiencyMeter | None = None
        self._counter: FlopCounter | None = None
        self._peaks = PeakLookup(None)  # the peak-table entry and why, set at fit start
        self._device_name: str | None = None
        self._precision = "fp32"
        self._told_no_peak = False
        self._flop_batch_size = 0.0
        self._last_step = 0  # global step at the end of the previous batch (a batch that moves it stepped)
        self._step_label = 0
        idle_unused(self)

    @property
    def flops_per_sample(self) -> float | None:
        """Training FLOPs per sample: the given value, or the counted one once the first step ran."""
        return self.meter.flops_per_sample if self.meter is not None else self._flops_per_sample

    # ------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The peak lookup (and its notice) here, before the progress bar starts drawing.
        if stage == "fit":
            self._look_up_peaks(trainer)

    def _look_up_peaks(self, trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        self._device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self._precision = matmul_precision(trainer.precision)
        if self.peak_flops is not None:
            self._peaks = PeakLookup(None, {}, "given as peak_flops")
        elif device.type == "cuda":  # the name, and where it is ambiguous the memory, SMs and power limit
            self._peaks = cuda_device_facts(device.index or 0).lookup()
        else:
            self._peaks = lookup_peaks(self._device_name)
        wanted = self._flops_per_sample or self.count_flops
        # A CPU has no datasheet peak (it depends on its cores, clock and vector units): no MFU there is expected, not
        # a fault to fix, so a CPU run prints no notice; the report's ``peak_reason`` says why.
        unknown = self.peak_flops is None and self._peaks.entry is None and device.type != "cpu"
        if unknown and wanted and not self._told_no_peak:
            self._told_no_peak = True  # once per monitor, however many fits
            rank_zero_info(
                f"EfficiencyMonitor: no peak FLOP/s known for {self._device_name!r} ({self._peaks.reason}), so no MFU."
                " Fix: pass EfficiencyMonitor(peak_flops=...) (dense FLOP/s of one device, or a dict by dtype)."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._device_name is None:  # a fit that skipped setup (the hooks called by hand)
            self._look_up_peaks(trainer)
        device = trainer.strategy.root_device
        counting = self._flops_per_sample is None and self.count_flops
        stats = getattr(trainer.strategy, "comm_stats", None)
        if counting and isinstance(stats, PipelineBubbleStats) and stats.pipelined:
            counting = False  # FlopCounterMode's module hooks break torch's pipeline stages (their autograd.grad)
            rank_zero_info("EfficiencyMonitor: no FLOP count under a pipeline schedule. Fix: pass flops_per_sample.")
        strategy = trainer.strategy
        self.meter = EfficiencyMeter(
            device,
            world_size=trainer.world_size,
            warmup_steps=max(self.warmup_steps, 1) if counting else self.warmup_steps,
            flops_per_sample=self._flops_per_sample,
            peak_flops=self.peak_flops if self.peak_flops is not None else (dict(self._peaks.peaks) or None),
            precision=self._precision,
            baseline_samples_per_sec=self.baseline_samples_per_sec,
            comm_stats=strategy.comm_stats if isinstance(strategy, CommStatsProvider) else None,
            exact_comm_timing=self.exact_comm_timing,
            straggler_threshold=self.straggler_threshold,
            straggler_windows=self.straggler_windows,
            max_recompiles=self.max_recompiles,
            clock=self._clock,
            warn=rank_zero_warn,
            info=rank_zero_info,
        )
        self._counter = FlopCounter() if counting else None
        self._step_label, self._last_step = batches_that_stepped(trainer), trainer.global_step
        wake(self, "on_before_optimizer_step")
        if not counting:
            idle(self, EfficiencyMonitor, "on_before_optimizer_step")  # it only ends the FLOP count

    # ------------------------------------------------------------------ per-step path

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        meter = self.meter
        assert meter is not None
        counting = self._counter is not None and meter.flops_per_sample is None and not self._counter.active
        if not (meter.measuring or counting):
            meter.batch_start(0)
            return
        size = self.batch_size_fn(batch) if self.batch_size_fn is not None else _batch_size(batch)
        if meter.measuring:
            meter.batch_start(size, self.items_fn(batch) if self.items_fn is not None else None)
        else:  # the FLOP-counting micro-batch (a warm-up step)
            meter.batch_start(size)
            self._flop_batch_size = float(size)
            self._counter.start()  # type: ignore[union-attr]

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        assert self.meter is not None
        self.meter.forward_end()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.meter is not None
        self.meter.backward_end()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Stop before the optimizer runs (Shampoo or Muon run matmuls that are no model FLOPs). In manual optimization
        # a training_step may run several passes around several steps (a GAN): count all of it, until the batch ends.
        if pl_module.automatic_optimization:
            self._finish_flop_count()

    def _finish_flop_count(self) -> None:
        if self._counter is None or not self._counter.active:
            return
        idle(self, EfficiencyMonitor, "on_before_optimizer_step")  # counted: no work before the steps any more
        flops = self._counter.stop()
        assert self.meter is not None
        if flops > 0 and self._flop_batch_size > 0:
            size = self._flop_batch_size
            self.meter.set_flops(flops / size, {dtype: n / size for dtype, n in flops.by_dtype.items()})
        else:
            self._counter = None
            rank_zero_info(
                "EfficiencyMonitor: FlopCounterMode counted no FLOPs in the first training step, so no TFLOP/s or MFU."
                " Fix: pass EfficiencyMonitor(flops_per_sample=...)."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finish_flop_count()
        meter = self.meter
        assert meter is not None
        stepped = trainer.global_step > self._last_step  # one step, however many optimizers stepped in this batch
        self._last_step = trainer.global_step
        measuring = meter.measuring
        meter.batch_end(stepped)
        if not stepped:
            return
        self._step_label = batches_that_stepped(trainer)  # this step's index; Lightning increments it after this hook
        every = trainer.log_every_n_steps
        if measuring and every and (self._step_label + 1) % every == 0:
            self._log(trainer, meter.compute(step=self._step_label))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only validation inside fit interrupts a window (not the sanity check, which runs before training).
        if self.meter is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.meter.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.meter is not None:
            self.meter.resume()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._counter is not None and self._counter.active:
            self._counter.stop()

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if metrics and trainer.is_global_zero and trainer.log_every_n_steps:  # 0: Lightning logs nothing
            prefixed = {self.log_key_prefix + k: v for k, v in metrics.items()}
            for logger in trainer.loggers:
                logger.log_metrics(prefixed, step=self._step_label)

    # ------------------------------------------------------------ end of fit

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_flop_count()
        meter = self.meter
        assert meter is not None
        self._log(trainer, meter.compute(step=self._step_label, final=True))  # the unlogged tail, on every rank
        self.summary = meter.summary()
        if not self.summary:
            rank_zero_info(
                f"EfficiencyMonitor: the fit ran {meter.steps_seen} optimizer step(s), all of them warm-up"
                f" ({meter.warmup_steps}), so nothing was measured. Fix: train longer or lower warmup_steps."
            )
            return
        self.report = meter.report()
        self.report["config"].update(
            device=self._device_name,
            precision=self._precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            peak_entry=self._peaks.entry,
            peak_reason=self._peaks.reason,
            # why the comm figures are absent, when the strategy counts no collectives (e.g. Lightning's DDPStrategy)
            comm_note=comm_note(type(trainer.strategy).__name__, trainer.world_size, meter.comm_stats is not None),
        )
        if not trainer.is_global_zero:
            return
        config = self.report["config"]
        title = f"EfficiencyMonitor: {config['device']} x{config['world_size']}, {config['precision']}"
        if self.report_path is not None:
            figure = partial(efficiency_figure, meter.windows, title)
            save_report(self.report_path, self.report, figure, "EfficiencyMonitor", rank_zero_info)
        if self.print_summary:
            from rich.console import Console

            Console().print(efficiency_table(self.summary, title, peaks_caption(config), config["comm_note"]))


def _batch_size(batch: Any) -> int | float | Tensor:
    """Lightning's ``extract_batch_size``, with its answer for the common batch computed directly.

    A tensor, or a tuple/list of tensors with the same first dimension: that dimension (Lightning's walk would find
    it first and agree with every other); anything else goes through Lightning's walk (and its warnings).
    """
    if isinstance(batch, Tensor) and batch.ndim:
        return batch.shape[0]
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor) and batch[0].ndim:
        size = batch[0].shape[0]
        if all(isinstance(t, Tensor) and t.ndim and t.shape[0] == size for t in batch[1:]):
            return size
    return extract_batch_size(batch)
