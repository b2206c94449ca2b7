"""Live training-efficiency metrics (throughput, step breakdown, TFLOP/s, MFU, stragglers) with no per-step sync."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lit_accel.callbacks._flops import FlopCounter
from lit_accel.utilities._compat import batches_that_stepped
from lit_accel.utilities._peak_flops import lookup_peak_flops, matmul_precision
from lit_accel.utilities._timing import IntervalTimer, synchronize
from lit_accel.utilities._validation import check_int, check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EfficiencyMonitor"]

# Per-rank numbers of one logging window, gathered across ranks in one small collective at logging steps.
_FIELDS = (
    "window_s", "samples", "items", "steps", "data_wait_s", "busy_s", "peak_mem", "flops", "comm_bytes", "comm_s",
)  # fmt: skip
_W = {name: i for i, name in enumerate(_FIELDS)}


class EfficiencyMonitor(Callback):
    r"""Log throughput, step-time breakdown, TFLOP/s, MFU, stragglers and scaling efficiency, live and at the end.

    Works with any strategy. Timing follows torchtitan (``torchtitan/components/metrics.py``): each rank measures the
    wall-clock of a *logging window* (the optimizer steps between two logging steps) with the host clock; at a
    logging step it first makes device work visible (one ``torch.cuda.synchronize``), then reads the clock, then
    gathers a 10-number vector from every rank in **one** ``all_gather``. Between logging steps the hooks only read
    ``time.perf_counter`` and add Python numbers (plus two CUDA timing events per micro-batch on GPU): no tensor
    work, no host-device sync. Windows are aligned with optimizer steps (``trainer.global_step`` advancing within a
    batch), so gradient accumulation, including an epoch's shorter last window, is counted correctly; a batch in
    which several optimizers step (manual optimization, e.g. a GAN) is one step. Validation
    runs inside the fit are excluded from every time. The first ``warmup_steps`` optimizer steps (compilation,
    autotuning, the FLOP-counting step) are neither logged nor averaged.

    Logged from rank 0 through every ``trainer.loggers`` entry at the trainer's cadence (every
    ``log_every_n_steps``-th step, as Lightning's own logging; ``0``: only the summary at the end of fit), at the
    step value Lightning uses for that optimizer step's own
    ``training_step`` metrics, so rows line up with ``train_loss``. ``W`` is the window's wall-clock (the slowest
    rank's), ``n`` the world size, ``S`` the samples of all ranks in the window (per-rank batches may differ), ``k`` the
    optimizer steps in it. GB = 1e9 bytes.

    ==================================  ========  ==========================================================  ======
    key (after ``log_key_prefix``)      unit      formula                                                     source
    ==================================  ========  ==========================================================  ======
    ``samples_per_sec``                 1/s       S / W (global, all ranks)                                   [1]
    ``samples_per_sec_per_device``      1/s       S / W / n                                                   [1]
    ``items_per_sec``                   1/s       sum of ``items_fn(batch)`` / W (only with ``items_fn``)      [1]
    ``step_time_ms``                    ms        1000 W / k: one optimizer step with all its micro-batches   [1]
    ``data_wait_frac``                  1         mean over ranks of (host time from one micro-batch's end    [1]
                                                  to the next one's start) / W: dataloader, host-to-device
                                                  copy and loop overhead
    ``tflops_per_device``               TFLOP/s   flops_per_sample x S / W / n / 1e12                         [2]
    ``mfu``                             1         flops_per_sample x S / W / n / peak (dense, by precision);   [2]
                                                  never logged above 1.0 (a warning says the peak is wrong)
    ``peak_memory_gb``                  GB        max over ranks of ``torch.cuda.max_memory_allocated``
                                                  (CUDA only; peak since the process started or its last reset)
    ``step_time_spread``                1         max / min over ranks of busy time = data wait + forward     [3]
                                                  (n > 1 only)
    ``scaling_efficiency``              1         samples_per_sec_per_device / ``baseline_samples_per_sec``   [4]
    ``allreduce_gb_per_step``           GB        bytes all-reduced per optimizer step per rank (AccelDDP)    [5]
    ``allreduce_busbw_gbps``            GB/s      bytes / all-reduce time x 2(n-1)/n (AccelDDP)               [5]
    ``allreduce_time_frac``             1         mean over ranks of all-reduce time / W: the share of the    [5]
                                                  step with a gradient collective in flight (overlapped with
                                                  the backward, so not all of it is exposed) (AccelDDP)
    ==================================  ========  ==========================================================  ======

    [1] torchtitan ``components/metrics.py``: wall-clock per logging window, data-loading time share.
    [2] PaLM (Chowdhery et al. 2022), appendix B: MFU = achieved model FLOP/s / peak FLOP/s. FLOPs per sample are
    counted once by ``torch.utils.flop_counter.FlopCounterMode`` over the first real training micro-batch (matmul
    FLOPs of forward + backward; activation recomputation would be counted too), or given as ``flops_per_sample``.
    In automatic optimization the count stops before the optimizer step; in manual optimization it spans the whole
    ``training_step`` (a GAN's passes), so an optimizer that runs matmuls (Shampoo, Muon) is counted too: pass
    ``flops_per_sample`` there.
    Peaks: :mod:`lit_accel.utilities._peak_flops` (dense datasheet figures), or ``peak_flops``.
    [3] DDP's all-reduce makes every rank's wall-clock window equal, so the spread compares work that excludes
    waiting on peers: data wait + forward (``on_train_batch_start`` to ``on_before_backward``; CUDA events on GPU).
    Caveat: Lightning broadcasts a SIGTERM flag from rank 0 before every batch fetch (``training_epoch_loop.py``),
    so under gradient accumulation a rank's wait for a slow rank 0 lands in its data wait and hides a data
    straggler; compute stragglers stay visible.
    [4] Strong-scaling efficiency (T1 / TK) / K = per-device throughput at K devices / throughput of one device.
    [5] nccl-tests ``doc/PERFORMANCE.md``: algbw = bytes / time, busbw = algbw x 2(n-1)/n for all-reduce (a ring
    all-reduce moves 2K(n-1)/n bytes per device for a K-byte buffer). Read from ``strategy.comm_stats`` (any object
    with ``bytes`` and ``pop_elapsed_s()``: ``lit_accel.strategies._comm_hooks.SupportsCommStats``), which AccelDDP
    fills in one of two ways. *Default (no comm hook; DDP's built-in all-reduce):* bytes = all-reduce rounds in the
    window (one per synchronised backward) x the gradient bytes of DDP's buckets, exact; time = those rounds x DDP's
    own per-round communication time (``backward_comm_time``, from the first bucket's launch to the last one's
    completion) of its latest *sampled* round (every round on CPU; every ``log_every_n_steps`` rounds on CUDA, so
    the figure may come from up to one logging interval earlier): an estimate, not a measurement of this window.
    *With ``AccelDDP(comm_hook=...)``:* bytes = what the hook put on the wire (after compression), and time = the
    measured span during which at least one bucket was in flight in this window. Either way the time starts when DDP
    hands a bucket over, so it includes any queueing behind the backward: with buckets overlapping the backward,
    busbw is a lower bound of the link's.

    Host-side data wait does not stall a GPU that still has queued work, so on GPU ``data_wait_frac`` is an upper
    bound of the stall. At the end of fit, rank 0 prints a ``rich`` table and writes ``report_path`` (JSON: every
    average over the non-warm-up windows, the per-window metrics and the configuration); :attr:`summary` holds the
    averages on every rank.

    Args:
        warmup_steps: optimizer steps at the start of each fit that are not measured. At least 1 is used while
            FLOPs are counted (that step runs under ``FlopCounterMode``).
        batch_size_fn: ``batch -> number of samples`` of a micro-batch on this rank (default: Lightning's
            ``extract_batch_size``). A 0-d tensor is accepted; it is summed on device and read at logging steps.
        items_fn: ``batch -> items`` (e.g. tokens) of a micro-batch, enabling ``items_per_sec``; same rules.
        flops_per_sample: training FLOPs (forward + backward) per sample; skips automatic counting.
        count_flops: count FLOPs automatically when ``flops_per_sample`` is not given.
        peak_flops: dense peak FLOP/s of one device, overriding the table (needed for MFU on CPU).
        baseline_samples_per_sec: throughput of a one-device run, enabling ``scaling_efficiency``.
        report_path: where rank 0 writes the JSON report at the end of fit (``None``: no file).
        print_summary: print the end-of-fit table on rank 0.
        log_key_prefix: prefix of every logged key.
        clock: the host clock in seconds (injectable for tests).

    Raises:
        ValueError: a non-positive ``flops_per_sample``, ``peak_flops`` or ``baseline_samples_per_sec``, or a
            negative ``warmup_steps``.
        TypeError: a non-callable ``batch_size_fn``/``items_fn``/``clock``, or a non-integer ``warmup_steps``.

    Example::

        from lightning.pytorch import Trainer
        from lit_accel import EfficiencyMonitor

        monitor = EfficiencyMonitor(warmup_steps=5, report_path="efficiency.json")
        trainer = Trainer(accelerator="gpu", devices=8, precision="bf16-mixed", callbacks=[monitor])
        trainer.fit(model, datamodule=dm)
        print(monitor.summary.get("mfu"))  # absent when the peak is unknown
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 3,
        batch_size_fn: Callable[[Any], int | float | Tensor] | None = None,
        items_fn: Callable[[Any], int | float | Tensor] | None = None,
        flops_per_sample: float | None = None,
        count_flops: bool = True,
        peak_flops: float | None = None,
        baseline_samples_per_sec: float | None = None,
        report_path: str | os.PathLike[str] | None = None,
        print_summary: bool = True,
        log_key_prefix: str = "perf/",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_int("EfficiencyMonitor", "warmup_steps", warmup_steps, minimum=0, example=3)
        for name, value, fix in (
            ("flops_per_sample", flops_per_sample, "omit it to count FLOPs automatically"),
            ("peak_flops", peak_flops, "omit it to use the datasheet table, e.g. 989.5e12 for an H100 SXM at bf16"),
            ("baseline_samples_per_sec", baseline_samples_per_sec, "pass the samples/s of a one-device run"),
        ):
            check_number("EfficiencyMonitor", name, value, allow_none=True, fix=fix)
        for name, fn in (("batch_size_fn", batch_size_fn), ("items_fn", items_fn), ("clock", clock)):
            if fn is not None and not callable(fn):
                raise TypeError(f"EfficiencyMonitor({name}={fn!r}): expected a callable or None.")
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.items_fn = items_fn
        self.flops_per_sample: float | None = None if flops_per_sample is None else float(flops_per_sample)
        self._user_flops = self.flops_per_sample is not None
        self.count_flops = count_flops
        self.peak_flops: float | None = None if peak_flops is None else float(peak_flops)
        self._user_peak = self.peak_flops is not None
        self.baseline_samples_per_sec = baseline_samples_per_sec
        self.report_path = None if report_path is None else Path(report_path)
        self.print_summary = print_summary
        self.log_key_prefix = log_key_prefix
        self._clock = clock
        self.summary: dict[str, float] = {}
        self.report: dict[str, Any] = {}
        self._val_start: float | None = None

    # ------------------------------------------------------------------ set-up
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._device_name = (
            torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else self._device.type
        )
        self._precision = matmul_precision(trainer.precision)
        if not self._user_flops:
            self.flops_per_sample = None
        if not self._user_peak:
            self.peak_flops = lookup_peak_flops(self._device_name, self._precision)
        if self.peak_flops is None and (self._user_flops or self.count_flops):
            rank_zero_info(
                f"EfficiencyMonitor: no peak FLOP/s known for {self._device_name!r} at {self._precision};"
                f" {self.log_key_prefix}mfu will not be logged. Pass EfficiencyMonitor(peak_flops=...) (dense FLOP/s"
                " of one device) to enable it."
            )
        self._counter = FlopCounter() if (self.count_flops and not self._user_flops) else None
        self._flop_batch_size = 0.0
        self._fwd = IntervalTimer(self._device, self._clock)
        self._warned_mfu = False
        self._steps_seen = 0
        self._window_start: float | None = None
        self._acc = dict.fromkeys(_FIELDS, 0.0)
        self._tensor_acc: dict[str, list[Tensor]] = {"samples": [], "items": []}
        self._totals: list[list[float]] | None = None
        self._total_window_s = 0.0
        self._windows: list[dict[str, float]] = []
        self._val_start = None
        self._val_in_gap = self._val_in_window = self._val_at_step = 0.0
        self._step_label = batches_that_stepped(trainer)
        self._last_step_end = self._last_end = self._clock()
        if self._warmup() == 0:
            self._open_window(trainer, self._last_end)

    def _warmup(self) -> int:
        return max(self.warmup_steps, 1) if self._counter is not None else self.warmup_steps

    def _open_window(self, trainer: pl.Trainer, now: float) -> None:
        self._window_start = now
        self._val_in_window = 0.0
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            self._comm_bytes0 = float(stats.bytes)
            stats.pop_elapsed_s()  # drop the warm-up collectives

    # ------------------------------------------------------------ per-step path
    def _add(self, key: str, value: int | float | Tensor) -> None:
        if isinstance(value, Tensor):
            self._tensor_acc[key].append(value.detach())
        else:
            self._acc[key] += value

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._clock()
        open_ = self._window_start is not None
        if open_:
            self._acc["data_wait_s"] += now - self._last_end - self._val_in_gap
            self._fwd.start()
        self._val_in_gap = 0.0
        self._in_forward = True
        self._batch_step = trainer.global_step
        if open_ or (self._counter is not None and self.flops_per_sample is None and not self._counter.active):
            size = self.batch_size_fn(batch) if self.batch_size_fn is not None else extract_batch_size(batch)
            if open_:
                self._add("samples", size)
                if self.items_fn is not None:
                    self._add("items", self.items_fn(batch))
            else:  # the FLOP-counting micro-batch (a warm-up step)
                self._flop_batch_size = float(size)
                self._counter.start()  # type: ignore[union-attr]

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._in_forward:
            self._in_forward = False
            self._fwd.stop()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Stop before the optimizer runs: optimizers such as Shampoo or Muon run matmuls that are no model FLOPs. In
        # manual optimization a training_step may run several forward/backward passes around several steps (a GAN):
        # count all of it, until the batch ends.
        if pl_module.automatic_optimization:
            self._finish_flop_count()

    def _finish_flop_count(self) -> None:
        if self._counter is None or not self._counter.active:
            return
        flops = self._counter.stop()
        if flops > 0 and self._flop_batch_size > 0:
            self.flops_per_sample = flops / self._flop_batch_size
        else:
            self._counter = None
            rank_zero_info(
                "EfficiencyMonitor: FlopCounterMode counted no FLOPs in the first training step; TFLOP/s and MFU"
                " will not be logged. Pass EfficiencyMonitor(flops_per_sample=...) to enable them."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finish_flop_count()
        self._in_forward = False
        if trainer.global_step > self._batch_step:  # one step, however many optimizers stepped in this batch
            now = self._clock()
            label = batches_that_stepped(trainer)  # this step's index; Lightning increments it after this hook
            self._steps_seen += 1
            self._step_label, self._last_step_end, self._val_at_step = label, now, self._val_in_window
            if self._window_start is not None:
                self._acc["steps"] += 1
                every = trainer.log_every_n_steps
                if every and (label + 1) % every == 0:
                    self._close_window(trainer, self._step_label)
            elif self._steps_seen >= self._warmup():
                # One sync when measuring starts, so warm-up work still queued on the device stays out of it.
                synchronize(self._device)
                self._open_window(trainer, self._clock())
        self._last_end = self._clock()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only validation inside fit interrupts a window (not the sanity check, which runs before training).
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._val_start = self._clock()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None:
            spent = self._clock() - self._val_start
            self._val_in_gap += spent
            self._val_in_window += spent
            self._val_start = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if getattr(self, "_counter", None) is not None and self._counter.active:  # type: ignore[union-attr]
            self._counter.stop()  # type: ignore[union-attr]

    # --------------------------------------------------------- logging steps
    def _close_window(self, trainer: pl.Trainer, label: int, end: float | None = None) -> None:
        synchronize(self._device)
        now = self._clock()
        acc = self._acc
        if end is None:
            end, val = now, self._val_in_window
        else:  # the tail flushed at on_train_end ends at the last optimizer step: later validation is not in it
            val = self._val_at_step
        acc["window_s"] = end - self._window_start - val  # type: ignore[operator]
        for key, tensors in self._tensor_acc.items():
            if tensors:  # the one device read of user-returned tensors, at a logging step
                acc[key] += float(torch.stack([t.to(self._dtype()) for t in tensors]).sum().item())
                tensors.clear()
        acc["busy_s"] = acc["data_wait_s"] + self._fwd.pop_total_s()
        if self._device.type == "cuda":
            acc["peak_mem"] = float(torch.cuda.max_memory_allocated(self._device))
        acc["flops"] = (self.flops_per_sample or 0.0) * acc["samples"]
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            acc["comm_bytes"], self._comm_bytes0 = float(stats.bytes) - self._comm_bytes0, float(stats.bytes)
            acc["comm_s"] = float(stats.pop_elapsed_s())
        rows = self._gather(trainer, [acc[f] for f in _FIELDS])
        window_s = max(r[_W["window_s"]] for r in rows)
        metrics = self._metrics(rows, window_s, has_comm=stats is not None)
        if self._totals is None:
            self._totals = [[0.0] * len(_FIELDS) for _ in rows]
        for total, row in zip(self._totals, rows):
            for i, value in enumerate(row):
                total[i] = max(total[i], value) if _FIELDS[i] == "peak_mem" else total[i] + value
        self._total_window_s += window_s
        self._windows.append({"step": label, **metrics})
        if trainer.is_global_zero and trainer.log_every_n_steps:  # 0: Lightning logs nothing (barebones)
            prefixed = {self.log_key_prefix + k: v for k, v in metrics.items()}
            for logger in trainer.loggers:
                logger.log_metrics(prefixed, step=label)
        self._acc = dict.fromkeys(_FIELDS, 0.0)
        # Windows tile the run (the next starts where this one ended), but this logging work is not data wait.
        self._window_start, self._val_in_window = now, 0.0
        self._last_end = self._clock()

    def _gather(self, trainer: pl.Trainer, values: list[float]) -> list[list[float]]:
        gathered = trainer.strategy.all_gather(torch.tensor(values, dtype=self._dtype(), device=self._device))
        return gathered.reshape(-1, len(values)).cpu().tolist()

    def _dtype(self) -> torch.dtype:
        return torch.float32 if self._device.type == "mps" else torch.float64  # MPS has no float64

    def _metrics(self, rows: list[list[float]], window_s: float, has_comm: bool) -> dict[str, float]:
        """Window (or whole-run) metrics from per-rank rows; ``window_s`` is the global wall-clock."""
        n = len(rows)

        def total(name: str) -> float:
            return sum(r[_W[name]] for r in rows)

        steps = rows[0][_W["steps"]]
        if window_s <= 0 or steps <= 0:
            return {}
        per_device = total("samples") / window_s / n
        out = {
            "samples_per_sec": total("samples") / window_s,
            "samples_per_sec_per_device": per_device,
            "step_time_ms": 1e3 * window_s / steps,
            "data_wait_frac": sum(r[_W["data_wait_s"]] / r[_W["window_s"]] for r in rows if r[_W["window_s"]] > 0) / n,
        }
        if self.items_fn is not None:
            out["items_per_sec"] = total("items") / window_s
        if self.flops_per_sample is not None:
            flops_per_device_s = total("flops") / window_s / n
            out["tflops_per_device"] = flops_per_device_s / 1e12
            if self.peak_flops is not None:
                mfu = flops_per_device_s / self.peak_flops
                if mfu <= 1.0:
                    out["mfu"] = mfu
                elif not self._warned_mfu:
                    self._warned_mfu = True
                    rank_zero_warn(
                        f"EfficiencyMonitor: measured {flops_per_device_s / 1e12:.4g} TFLOP/s per device, above the"
                        f" peak of {self.peak_flops / 1e12:.4g} TFLOP/s used for {self._device_name!r} at"
                        f" {self._precision}; MFU would exceed 100%, so it is not logged. The peak (or"
                        " flops_per_sample) is wrong: pass EfficiencyMonitor(peak_flops=...) with the dense figure."
                    )
        if self._device.type == "cuda":
            out["peak_memory_gb"] = max(r[_W["peak_mem"]] for r in rows) / 1e9
        busy = [r[_W["busy_s"]] for r in rows]
        if n > 1 and min(busy) > 0:
            out["step_time_spread"] = max(busy) / min(busy)
        if self.baseline_samples_per_sec is not None:
            out["scaling_efficiency"] = per_device / self.baseline_samples_per_sec
        comm_bytes, comm_s = total("comm_bytes") / n, total("comm_s") / n
        if has_comm and comm_bytes > 0:
            out["allreduce_gb_per_step"] = comm_bytes / steps / 1e9
            if comm_s > 0 and n > 1:
                out["allreduce_busbw_gbps"] = comm_bytes / comm_s * 2 * (n - 1) / n / 1e9
                out["allreduce_time_frac"] = sum(r[_W["comm_s"]] / r[_W["window_s"]] for r in rows) / n
        return out

    # ------------------------------------------------------------ end of fit
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_flop_count()
        if self._window_start is not None and self._acc["steps"] > 0:
            # Flush the unlogged tail (same steps on every rank). It ends at the last optimizer step on CPU; on GPU
            # after a sync now, since the host may have run ahead of the device.
            end = None if self._device.type == "cuda" else self._last_step_end
            self._close_window(trainer, self._step_label, end=end)
        if self._totals is None:
            rank_zero_info(
                f"EfficiencyMonitor: the fit ran {self._steps_seen} optimizer step(s), all of them warm-up"
                f" ({self._warmup()}), so nothing was measured. Train longer or lower warmup_steps."
            )
            return
        stats = getattr(trainer.strategy, "comm_stats", None)
        self.summary = self._metrics(self._totals, self._total_window_s, has_comm=stats is not None)
        self.summary["measured_steps"] = self._totals[0][_W["steps"]]
        self.report = {
            "config": {
                "device": self._device_name,
                "precision": self._precision,
                "world_size": len(self._totals),
                "peak_flops": self.peak_flops,
                "flops_per_sample": self.flops_per_sample,
                "warmup_steps": self._warmup(),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "baseline_samples_per_sec": self.baseline_samples_per_sec,
            },
            "averages": self.summary,
            "windows": self._windows,
        }
        if not trainer.is_global_zero:
            return
        if self.report_path is not None:
            self.report_path.parent.mkdir(parents=True, exist_ok=True)
            self.report_path.write_text(json.dumps(self.report, indent=2))
        if self.print_summary:
            self._print_table()

    def _print_table(self) -> None:
        from rich.console import Console
        from rich.table import Table

        cfg, s = self.report["config"], self.summary
        table = Table(title=f"EfficiencyMonitor: {cfg['device']} x{cfg['world_size']}, {cfg['precision']}")
        table.add_column("metric")
        table.add_column("average", justify="right")
        rows = [
            ("samples/s (global)", "samples_per_sec", "{:,.1f}"),
            ("samples/s per device", "samples_per_sec_per_device", "{:,.1f}"),
            ("items/s (global)", "items_per_sec", "{:,.1f}"),
            ("step time (ms)", "step_time_ms", "{:,.2f}"),
            ("data wait (% of step)", "data_wait_frac", "{:.1%}"),
            ("TFLOP/s per device", "tflops_per_device", "{:,.2f}"),
            ("MFU", "mfu", "{:.1%}"),
            ("peak memory (GB)", "peak_memory_gb", "{:,.2f}"),
            ("straggler spread (max/min busy)", "step_time_spread", "{:.3f}"),
            ("scaling efficiency", "scaling_efficiency", "{:.1%}"),
            ("all-reduce GB per step", "allreduce_gb_per_step", "{:.4f}"),
            ("all-reduce bus bandwidth (GB/s)", "allreduce_busbw_gbps", "{:,.2f}"),
            ("all-reduce in flight (% of step)", "allreduce_time_frac", "{:.1%}"),
            ("measured optimizer steps", "measured_steps", "{:.0f}"),
        ]
        for label, key, fmt in rows:
            if key in s:
                table.add_row(label, fmt.format(s[key]))
        Console().print(table)
