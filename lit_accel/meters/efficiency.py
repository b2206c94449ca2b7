"""``EfficiencyMeter``: throughput, step breakdown, TFLOP/s, MFU, stragglers and communication of a training loop.

No Lightning here: the meter is driven by five calls per micro-batch from any loop (raw PyTorch, Fabric, or the
``EfficiencyMonitor`` callback, which is a thin adapter over it). Between logging steps it only reads the host clock
(CUDA events on GPU) and adds Python numbers; at a logging step :meth:`EfficiencyMeter.compute` makes device work
visible (one synchronize), gathers one small vector per rank in one ``all_gather`` and turns the window into metrics.
Timing follows torchtitan's ``components/metrics.py``; formulas and sources: ``docs/monitors.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_accel.meters._efficiency_metrics import (
    EfficiencyConfig,
    RankWindow,
    checked_peak_flops,
    read_comm,
    window_metrics,
)
from lit_accel.meters._stragglers import StragglerWatch, gather_hostnames
from lit_accel.protocols import CommTiming, ExposedComm
from lit_accel.utilities._compat import dynamo_compile_counts
from lit_accel.utilities._timing import IntervalTimer, synchronize
from lit_accel.utilities._torch_fallbacks import all_gather_single
from lit_accel.utilities._validation import check_bool, check_int, check_number
from lit_accel.utilities._warnings import rank_zero_warn

if TYPE_CHECKING:
    from lit_accel.protocols import CommStats

__all__ = ["EfficiencyMeter", "checked_peak_flops"]

_log = logging.getLogger(__name__)


@dataclass
class _Progress:
    """Where the meter is inside the current window (host numbers only)."""

    steps_seen: int = 0
    window_start: float | None = None
    last_end: float = 0.0
    last_step_end: float = 0.0
    paused_at: float | None = None
    paused_in_gap: float = 0.0
    paused_in_window: float = 0.0
    paused_at_step: float = 0.0
    in_forward: bool = False
    in_backward: bool = False
    comm_bytes_at_start: float = 0.0
    comm_bus_bytes_at_start: float = 0.0
    window: RankWindow = field(default_factory=RankWindow)
    compiles_at_start: tuple[int, int] = (0, 0)
    recompiles_at_warm: int = 0
    device_counts: dict[str, list[Tensor]] = field(default_factory=lambda: {"samples": [], "items": []})


class EfficiencyMeter:
    """Measure a training loop's efficiency without a host-device sync between logging steps.

    Per micro-batch call :meth:`batch_start` (with its sample count), :meth:`forward_end`, :meth:`backward_end`
    (optional: it lets the straggler attribution see the backward) and :meth:`batch_end` (``stepped=True`` when an
    optimizer step ended it); at logging steps :meth:`compute` returns the window's metrics (every rank must call
    it: it gathers), and :meth:`summary` the averages over all windows. The first ``warmup_steps`` optimizer steps
    are not measured; :meth:`pause`/:meth:`resume` keep validation out.

    Args:
        device: the device the loop runs on (CUDA: timed with events, peak memory read).
        world_size: ranks taking part (default: the process group's, 1 without one).
        warmup_steps: optimizer steps at the start that are not measured.
        flops_per_sample: training FLOPs (forward + backward) per sample, enabling TFLOP/s (:meth:`set_flops` later).
        peak_flops: dense peak FLOP/s of one device (or a dict by dtype key, e.g. ``{"bf16": ..., "fp32": ...}``).
        precision: the dtype key of FLOPs given without a split by dtype (``"bf16"``, ``"fp32"``, ...).
        baseline_samples_per_sec: one device's throughput, enabling ``scaling_efficiency``.
        comm_stats: the strategy's collective counters (:class:`lit_accel.protocols.CommStats`), or ``None``.
        exact_comm_timing: ask ``comm_stats`` to time every collective (``CommTiming``; before the first backward)
            rather than estimate (AccelDDP: a Python hook per bucket, host time each step, not DDP's sampled rounds).
        straggler_threshold: a rank is named when its own time exceeds the others' median by more than this share.
        straggler_windows: consecutive windows naming the same rank before the warning.
        max_recompiles: torch.compile recompilations after the warm-up before a warning (``None``: never).
        clock: host clock in seconds (for tests). warn, info: where warnings (default: rank 0 only) and notes go.

    Example::

        meter = EfficiencyMeter(device, flops_per_sample=6 * n_params)
        for step, (x, y) in enumerate(loader):
            meter.batch_start(len(x))
            loss = loss_fn(model(x), y)
            meter.forward_end()
            loss.backward()
            meter.backward_end()
            opt.step(); opt.zero_grad()
            meter.batch_end(stepped=True)
            if (step + 1) % 50 == 0:
                print(meter.compute())
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        world_size: int | None = None,
        warmup_steps: int = 3,
        flops_per_sample: float | None = None,
        peak_flops: float | Mapping[str, float] | None = None,
        precision: str = "fp32",
        baseline_samples_per_sec: float | None = None,
        comm_stats: CommStats | None = None,
        exact_comm_timing: bool = False,
        straggler_threshold: float = 0.2,
        straggler_windows: int = 3,
        max_recompiles: int | None = 8,
        clock: Callable[[], float] = time.perf_counter,
        warn: Callable[[str], Any] = rank_zero_warn,
        info: Callable[[str], Any] = _log.info,
    ) -> None:
        name = "EfficiencyMeter"
        check_int(name, "warmup_steps", warmup_steps, minimum=0, example=3)
        check_number(name, "flops_per_sample", flops_per_sample, allow_none=True)
        check_number(name, "straggler_threshold", straggler_threshold, fix="pass a share such as 0.2 (20% slower)")
        check_int(name, "straggler_windows", straggler_windows, example=3)
        check_int(name, "max_recompiles", max_recompiles, minimum=0, allow_none=True, example=8)
        self.device = torch.device(device)
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.world_size = world_size
        self.warmup_steps = warmup_steps
        self.max_recompiles = max_recompiles
        self.config = EfficiencyConfig(
            flops_per_sample=None if flops_per_sample is None else float(flops_per_sample),
            precision=precision,
            peak_flops=checked_peak_flops(name, peak_flops, "pass the dense FLOP/s of one device, e.g. 989.5e12"),
            baseline_samples_per_sec=baseline_samples_per_sec,
            cuda=self.device.type == "cuda",
            straggler_threshold=float(straggler_threshold),
        )
        self.comm_stats = comm_stats
        check_bool(name, "exact_comm_timing", exact_comm_timing)
        if exact_comm_timing and isinstance(comm_stats, CommTiming):
            comm_stats.request_timing()  # AccelDDP: its timing hook, instead of DDP's sampled rounds
        self.count_items = False
        self._clock, self._warn, self._info = clock, warn, info
        self._forward = IntervalTimer(self.device, clock)
        self._backward = IntervalTimer(self.device, clock)
        self._progress = _Progress()
        self._totals: list[RankWindow] | None = None
        self._total_window_s = 0.0
        #: ``{"step": index, **metrics}`` of every computed window.
        self.windows: list[dict[str, float]] = []
        self.stragglers = StragglerWatch(straggler_windows, warn, lambda: gather_hostnames(self.world_size))
        self._said: set[str] = set()  # notes and warnings given once
        self.reset()

    @property
    def flops_per_sample(self) -> float | None:
        """Training FLOPs per sample (``None``: no TFLOP/s or MFU)."""
        return self.config.flops_per_sample

    @flops_per_sample.setter
    def flops_per_sample(self, value: float | None) -> None:
        self.set_flops(value)

    def set_flops(self, per_sample: float | None, by_dtype: Mapping[str, float] | None = None) -> None:
        """Training FLOPs per sample and, optionally, their split by dtype key (e.g. ``FlopCount.by_dtype / batch``)."""
        self.config.flops_per_sample = None if per_sample is None else float(per_sample)
        self.config.flops_by_dtype = None if by_dtype is None else {k: float(v) for k, v in by_dtype.items()}

    @property
    def has_exposed_comm(self) -> bool:
        """Whether the strategy's counters measure exposed communication (:class:`lit_accel.protocols.ExposedComm`)."""
        return isinstance(self.comm_stats, ExposedComm)

    @property
    def steps_seen(self) -> int:
        """Optimizer steps seen since the last :meth:`reset`, warm-up included."""
        return self._progress.steps_seen

    @property
    def measuring(self) -> bool:
        """Whether a window is open (warm-up is over)."""
        return self._progress.window_start is not None

    def reset(self) -> None:
        """Forget everything measured (a new fit); the warm-up starts again."""
        now = self._clock()
        self._progress = _Progress(last_end=now, last_step_end=now, compiles_at_start=dynamo_compile_counts())
        self._totals, self._total_window_s, self.windows = None, 0.0, []
        self.stragglers.reset()
        if self.config.cuda:  # peak_memory_gb is this fit's, not the process's (peaks are process-wide)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.warmup_steps == 0:
            self._open(now)

    # ------------------------------------------------------------------ per micro-batch

    def batch_start(self, samples: int | float | Tensor, items: int | float | Tensor | None = None) -> None:
        """A micro-batch begins: the time since the previous one ended is data wait. Tensors are summed on device."""
        p = self._progress
        now = self._clock()
        if p.window_start is not None:
            p.window.data_wait_s += now - p.last_end - p.paused_in_gap
            self._forward.start()
            self._add("samples", samples)
            if items is not None:
                self.count_items = True
                self._add("items", items)
        p.paused_in_gap = 0.0
        p.in_forward = True

    def forward_end(self) -> None:
        """The micro-batch's forward is done; its backward begins."""
        p = self._progress
        if p.in_forward:
            p.in_forward, p.in_backward = False, True
            if p.window_start is not None:
                self._forward.stop()
                self._backward.start()

    def backward_end(self) -> None:
        """The micro-batch's backward returned (its gradient collectives included). Optional: see the class doc."""
        p = self._progress
        if p.in_backward:
            p.in_backward = False
            if p.window_start is not None:
                self._backward.stop()
                p.window.backwards += 1

    def batch_end(self, stepped: bool) -> None:
        """The micro-batch is done; ``stepped`` when an optimizer step (one or several optimizers) ended it."""
        p = self._progress
        self.forward_end()
        p.in_backward = False  # without backward_end the backward stays untimed
        if stepped:
            now = self._clock()
            p.steps_seen += 1
            p.last_step_end, p.paused_at_step = now, p.paused_in_window
            if p.window_start is not None:
                p.window.steps += 1
            elif p.steps_seen >= self.warmup_steps:
                synchronize(self.device)  # once, so warm-up work still queued on the device stays out
                self._open(self._clock())
        p.last_end = self._clock()

    def pause(self) -> None:
        """Stop the clock (validation inside fit): the time until :meth:`resume` counts nowhere."""
        self._progress.paused_at = self._clock()

    def resume(self) -> None:
        """Restart the clock after :meth:`pause`."""
        p = self._progress
        if p.paused_at is not None:
            spent = self._clock() - p.paused_at
            p.paused_in_gap += spent
            p.paused_in_window += spent
            p.paused_at = None

    def _add(self, key: str, value: int | float | Tensor) -> None:
        if isinstance(value, Tensor):
            self._progress.device_counts[key].append(value.detach())
        else:
            setattr(self._progress.window, key, getattr(self._progress.window, key) + value)

    def _open(self, now: float) -> None:
        p = self._progress
        p.window_start, p.paused_in_window, p.window = now, 0.0, RankWindow()
        p.recompiles_at_warm = dynamo_compile_counts()[1]
        if self.comm_stats is not None:  # the warm-up's collectives read into a window nobody keeps
            p.comm_bytes_at_start, p.comm_bus_bytes_at_start = read_comm(RankWindow(), self.comm_stats,
                                                                         self.world_size, (0.0, 0.0))  # fmt: skip

    # ------------------------------------------------------------------ logging steps

    def compute(self, step: int | None = None, *, final: bool = False) -> dict[str, float]:
        """Close the current window and return its metrics (empty during warm-up). Every rank must call it.

        Args:
            step: the index recorded with the window in :attr:`windows` (default: the optimizer steps seen).
            final: the end of training: on CPU the window ends at the last optimizer step, not now.
        """
        p = self._progress
        if p.window_start is None or p.window.steps <= 0:
            return {}
        synchronize(self.device)
        now = self._clock()
        end, paused = (
            (p.last_step_end, p.paused_at_step) if final and not self.config.cuda else (now, p.paused_in_window)
        )
        w = p.window
        w.window_s = end - p.window_start - paused
        dtype = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        _add_device_counts(w, p.device_counts, dtype)
        w.forward_s, w.backward_s = self._forward.pop_total_s(), self._backward.pop_total_s()
        w.busy_s = w.data_wait_s + w.forward_s
        compiles, recompiles = dynamo_compile_counts()
        w.compiles, w.recompiles = compiles - p.compiles_at_start[0], recompiles - p.compiles_at_start[1]
        w.warm_recompiles = recompiles - p.recompiles_at_warm
        if self.config.cuda:
            w.peak_memory_bytes = float(torch.cuda.max_memory_allocated(self.device))
        w.flops = (self.config.flops_per_sample or 0.0) * w.samples
        if self.comm_stats is not None:  # the counters run for the whole fit: this window's share
            at_start = (p.comm_bytes_at_start, p.comm_bus_bytes_at_start)
            p.comm_bytes_at_start, p.comm_bus_bytes_at_start = read_comm(w, self.comm_stats, self.world_size, at_start)
        rows = self._gather(w, dtype)
        window_s = max(r.window_s for r in rows)
        metrics = self._metrics(rows, window_s)
        label = p.steps_seen if step is None else step
        self._after_window(rows, label, metrics)
        self._add_to_totals(rows, window_s)
        self.windows.append({"step": label, **metrics})
        # Windows tile the run (the next starts where this one ended), but this logging work is not data wait.
        p.window_start, p.paused_in_window, p.window = now, 0.0, RankWindow()
        p.last_end = self._clock()
        return metrics

    def _add_to_totals(self, rows: list[RankWindow], window_s: float) -> None:
        """Add one window's rows (one per rank) to the run's totals, which :meth:`summary` averages."""
        if self._totals is None:
            self._totals = [RankWindow() for _ in rows]
        for total, row in zip(self._totals, rows):
            total.accumulate(row)
        self._total_window_s += window_s

    def summary(self) -> dict[str, float]:
        """Averages over every computed window (plus ``measured_steps``); empty when nothing was measured."""
        if self._totals is None:
            return {}
        summary = self._metrics(self._totals, self._total_window_s)
        summary["measured_steps"] = self._totals[0].steps
        return summary

    def _gather(self, window: RankWindow, dtype: torch.dtype) -> list[RankWindow]:
        # One path for any world size: the window as one small device tensor, gathered when there are peers.
        local = torch.tensor(window.vector(), dtype=dtype, device=self.device)
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered = torch.empty(self.world_size * local.numel(), dtype=dtype, device=self.device)
            all_gather_single(gathered, local)
            local = gathered
        return [RankWindow.from_vector(row) for row in local.reshape(-1, len(window.vector())).cpu().tolist()]

    def _metrics(self, rows: list[RankWindow], window_s: float) -> dict[str, float]:
        metrics, issue = window_metrics(rows, window_s, self.config, self.comm_stats is not None, self.has_exposed_comm)
        if not self.count_items:
            metrics.pop("items_per_sec", None)
        if issue is not None and issue.too_high:
            self._once("mfu", self._warn, f"EfficiencyMeter: MFU is not reported: {issue.reason} Fix: pass the"
                       " device's dense peak as peak_flops, or check flops_per_sample.")  # fmt: skip
        elif issue is not None:
            self._once("mfu", self._info, f"EfficiencyMeter: no MFU: {issue.reason}. Fix: pass peak_flops={{...}}.")
        return metrics

    def _after_window(self, rows: list[RankWindow], label: int, metrics: dict[str, float]) -> None:
        """What needs more than one window: the straggler named (and its streak), the recompile storm."""
        if len(rows) > 1 and metrics:
            verdict = self.stragglers.observe(rows, self.has_exposed_comm, self.config.straggler_threshold, label)
            metrics["straggler_rank"] = float(verdict.rank)
        storm = max(r.warm_recompiles for r in rows)
        if self.max_recompiles is not None and storm > self.max_recompiles:
            self._once("recompiles", self._warn, (
                f"EfficiencyMeter: torch.compile recompiled {storm:.0f} times after the warm-up (more than"
                f" max_recompiles={self.max_recompiles}): each recompilation stalls the step. Fix: run with"
                " TORCH_LOGS=recompiles to see which guard fails (often a changing shape: pad it, or"
                " torch.compile(dynamic=True))."
            ))  # fmt: skip

    def _once(self, key: str, say: Callable[[str], Any], message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            say(message)

    def report(self) -> dict[str, Any]:
        """The JSON report: configuration, averages and every window."""
        config = {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name != "cuda"}
        ranks = []
        for rank, row in enumerate(self._totals or []):
            ranks.append({"rank": rank, **{f.name: getattr(row, f.name) for f in fields(row)}})
        return {
            "config": {**config, "world_size": self.world_size, "warmup_steps": self.warmup_steps},
            "averages": self.summary(),
            "windows": self.windows,
            "ranks": ranks,
            "stragglers": self.stragglers.records,
        }


def _add_device_counts(window: RankWindow, counts: dict[str, list[torch.Tensor]], dtype: torch.dtype) -> None:
    """Add the counts a step returned as device tensors to ``window``, in one device read per key, and clear them."""
    for key, tensors in counts.items():
        if tensors:  # the one device read of user-returned counts, at a logging step
            setattr(window, key, getattr(window, key) + float(torch.stack([t.to(dtype) for t in tensors]).sum().item()))
            tensors.clear()
