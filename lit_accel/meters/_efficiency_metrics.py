"""The arithmetic of :class:`~lit_accel.meters.EfficiencyMeter`: per-rank window numbers in, named metrics out.

Pure Python, so every formula is tested with exact numbers. ``W`` is a window's wall-clock (slowest rank), ``n`` the
world size, ``S`` the samples of all ranks, ``k`` the optimizer steps. Sources of the formulas: ``docs/monitors.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

from lit_accel.meters._stragglers import straggler_metrics
from lit_accel.protocols import BusBytes, ExposedComm, PipelineBubbleStats
from lit_accel.utilities._peak_flops import ideal_seconds, mfu
from lit_accel.utilities._validation import check_number

if TYPE_CHECKING:
    from lit_accel.protocols import CommStats

__all__ = [
    "EfficiencyConfig",
    "MfuIssue",
    "RankWindow",
    "checked_peak_flops",
    "comm_totals",
    "dtype_shares",
    "pipeline_metrics",
    "read_comm",
    "window_metrics",
]

# Cumulative counters (and the memory peak): a run's total is their maximum, not their sum.
_MAXIMA = frozenset({"peak_memory_bytes", "compiles", "recompiles", "warm_recompiles"})


@dataclass
class RankWindow:
    """One rank's numbers for one logging window (or, accumulated, for the whole run)."""

    window_s: float = 0.0
    samples: float = 0.0
    items: float = 0.0
    steps: float = 0.0
    data_wait_s: float = 0.0
    busy_s: float = 0.0  # data wait + forward: what step_time_spread compares
    forward_s: float = 0.0
    backward_s: float = 0.0
    backwards: float = 0.0  # backward intervals timed (0: the loop never called backward_end)
    peak_memory_bytes: float = 0.0
    flops: float = 0.0
    comm_bytes: float = 0.0
    comm_bus_bytes: float = 0.0
    comm_s: float = 0.0
    comm_exposed_s: float = 0.0
    compiles: float = 0.0  # torch.compile compilations since the meter's reset (cumulative)
    recompiles: float = 0.0  # ... of them recompilations
    warm_recompiles: float = 0.0  # recompilations since the warm-up ended
    pipeline_busy_s: float = 0.0  # in a pipeline stage's compute actions (PipelineBubbleStats)
    pipeline_wall_s: float = 0.0  # in the pipeline schedule's steps
    pipeline_idle_s: float = 0.0  # the idle time the schedule implies for the same action durations (analytic)

    def vector(self) -> list[float]:
        """The fields in declaration order, for one collective."""
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> RankWindow:
        """Inverse of :meth:`vector`."""
        return cls(*values)

    def accumulate(self, other: RankWindow) -> None:
        """Add ``other`` into this total (peak memory and the cumulative counters: the maximum)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name in _MAXIMA else mine + theirs)


@dataclass
class EfficiencyConfig:
    """What the metrics need besides the windows."""

    flops_per_sample: float | None = None
    #: FLOPs per sample by the dtype they ran in (sums to ``flops_per_sample``); ``None``: all in ``precision``.
    flops_by_dtype: dict[str, float] | None = None
    precision: str = "fp32"
    #: Dense peak FLOP/s of one device: one figure for every dtype, or one per dtype.
    peak_flops: float | dict[str, float] | None = None
    baseline_samples_per_sec: float | None = None
    cuda: bool = False
    straggler_threshold: float = 0.2


class MfuIssue(NamedTuple):
    """Why MFU is not reported although a peak is known: ``too_high`` (above 100%) or a dtype without a peak."""

    reason: str
    too_high: bool


def dtype_shares(config: EfficiencyConfig) -> dict[str, float]:
    """The share of the FLOPs each dtype ran (sums to 1); the whole count in ``precision`` without a split."""
    split = config.flops_by_dtype
    total = sum(split.values()) if split else 0.0
    if not split or total <= 0:
        return {config.precision: 1.0}
    return {d: f / total for d, f in split.items() if f > 0}


def _mfu(rows: list[RankWindow], window_s: float, config: EfficiencyConfig) -> tuple[float | None, MfuIssue | None]:
    """MFU = sum over dtypes d of flops_d / peak_d, over n x W device-seconds (docs/monitors.md)."""
    total = sum(r.flops for r in rows)
    by_dtype = {d: share * total for d, share in dtype_shares(config).items()}
    peak = config.peak_flops
    peaks: Mapping[str, float] = peak if isinstance(peak, dict) else {d: float(peak or 0.0) for d in by_dtype}
    estimate = mfu(by_dtype, peaks, measured_seconds=len(rows) * window_s)
    if estimate.value is not None:
        return estimate.value, None
    too_high = ideal_seconds(by_dtype, peaks).value is not None  # known peaks, but above 100%
    return None, MfuIssue(estimate.reason, too_high) if total > 0 else None


def comm_totals(comm_stats: CommStats, n: int) -> tuple[float, float]:
    """Cumulative payload bytes and ring ("bus") bytes of a strategy's collectives (all-reduces unless it says)."""
    total = float(comm_stats.bytes)
    if isinstance(comm_stats, BusBytes):
        return total, float(comm_stats.bus_bytes(n))
    return total, total * 2 * (n - 1) / n if n > 1 else 0.0


def read_comm(window: RankWindow, stats: CommStats, world_size: int,
              at_start: tuple[float, float]) -> tuple[float, float]:  # fmt: skip
    """Fill ``window``'s communication from the strategy's counters; returns their totals now.

    The bytes since ``at_start`` (the totals when the window began), the time, the exposed time and the pipeline's
    bubble where measured.
    """
    total, bus = comm_totals(stats, world_size)
    window.comm_bytes, window.comm_bus_bytes = total - at_start[0], bus - at_start[1]
    window.comm_s = float(stats.pop_elapsed_s())
    if isinstance(stats, ExposedComm):
        window.comm_exposed_s = float(stats.pop_exposed_s())
    if isinstance(stats, PipelineBubbleStats) and (bubble := stats.pop_pipeline_bubble()):
        window.pipeline_busy_s, window.pipeline_wall_s, window.pipeline_idle_s = bubble
    return total, bus


def window_metrics(
    rows: list[RankWindow], window_s: float, config: EfficiencyConfig, has_comm: bool, has_exposed: bool = False
) -> tuple[dict[str, float], MfuIssue | None]:
    """Metrics of one window (or the whole run) from every rank's row, and why MFU is missing (if a peak is known).

    Returns ``({}, None)`` for an empty window.
    """
    n = len(rows)
    steps = rows[0].steps
    if window_s <= 0 or steps <= 0:
        return {}, None
    samples = sum(r.samples for r in rows)
    out = {
        "samples_per_sec": samples / window_s,
        "samples_per_sec_per_device": samples / window_s / n,
        "items_per_sec": sum(r.items for r in rows) / window_s,
        "step_time_ms": 1e3 * window_s / steps,
        "data_wait_frac": sum(r.data_wait_s / r.window_s for r in rows if r.window_s > 0) / n,
    }
    flops, issue = _flops_metrics(rows, window_s, config)
    out.update(flops)
    out.update(_balance_metrics(rows, config, out["samples_per_sec_per_device"]))
    if has_comm:
        out.update(_comm_metrics(rows, steps))
    if has_exposed:
        out.update(_exposed_metrics(rows))
    if max(r.compiles for r in rows) > 0:
        out["recompiles"] = max(r.recompiles for r in rows)
    if n > 1:
        out.update(straggler_metrics(rows, has_exposed, config.straggler_threshold).metrics())
    out.update(pipeline_metrics(rows))
    return out, issue


def _flops_metrics(rows: list[RankWindow], window_s: float,
                   config: EfficiencyConfig) -> tuple[dict[str, float], MfuIssue | None]:  # fmt: skip
    """TFLOP/s per device and MFU where the FLOPs per sample (and the peak) are known, and why MFU is missing."""
    if config.flops_per_sample is None:
        return {}, None
    out = {"tflops_per_device": sum(r.flops for r in rows) / window_s / len(rows) / 1e12}
    if config.peak_flops is None:
        return out, None
    value, issue = _mfu(rows, window_s, config)
    if value is not None:
        out["mfu"] = value  # never above 1: the peak (or the FLOP count) would be wrong
    return out, issue


def _balance_metrics(rows: list[RankWindow], config: EfficiencyConfig, per_device: float) -> dict[str, float]:
    """The peak memory (CUDA), the spread of busy time over ranks and the scaling efficiency against a baseline."""
    out = {}
    if config.cuda:
        out["peak_memory_gb"] = max(r.peak_memory_bytes for r in rows) / 1e9
    busy = [r.busy_s for r in rows]
    if len(rows) > 1 and min(busy) > 0:
        out["step_time_spread"] = max(busy) / min(busy)
    if config.baseline_samples_per_sec is not None:
        out["scaling_efficiency"] = per_device / config.baseline_samples_per_sec
    return out


def _comm_metrics(rows: list[RankWindow], steps: int) -> dict[str, float]:
    """Communication volume per step and, across processes, its bus bandwidth and share of the window."""
    n = len(rows)
    comm_bytes, comm_s = sum(r.comm_bytes for r in rows) / n, sum(r.comm_s for r in rows) / n
    if comm_bytes <= 0:
        return {}
    out = {"comm_gb_per_step": comm_bytes / steps / 1e9}
    if comm_s > 0 and n > 1:
        # nccl-tests' bus bandwidth: the bytes the ring algorithms move per rank, over the time.
        out["comm_busbw_gbps"] = sum(r.comm_bus_bytes for r in rows) / n / comm_s / 1e9
        # At most 1 per rank: an estimate (AccelDDP's, from an earlier sampled round) can exceed a short window.
        out["comm_time_frac"] = sum(min(1.0, r.comm_s / r.window_s) for r in rows if r.window_s > 0) / n
    return out


def _exposed_metrics(rows: list[RankWindow]) -> dict[str, float]:
    """The window's share of communication nothing overlapped, and the compute fraction it leaves."""
    n = len(rows)
    out = {"comm_exposed_frac": sum(min(1.0, r.comm_exposed_s / r.window_s) for r in rows if r.window_s > 0) / n}
    # The source document's T_compute / (T_compute + T_comm), with T_compute = W - data wait - exposed comm.
    unblocked = sum(max(0.0, r.window_s - r.data_wait_s) for r in rows)
    if unblocked > 0:
        out["compute_frac"] = max(0.0, 1.0 - sum(r.comm_exposed_s for r in rows) / unblocked)
    return out


def pipeline_metrics(rows: list[RankWindow], per_rank_up_to: int = 64) -> dict[str, float]:
    """The pipeline bubble, ``1 - busy / wall`` per rank: mean, max, analytic mean; each rank's up to 64 ranks.

    Empty without a pipeline (no rank timed a schedule step).
    """
    ranks = [(i, r) for i, r in enumerate(rows) if r.pipeline_wall_s > 0]
    if not ranks:
        return {}
    measured = {i: 1.0 - r.pipeline_busy_s / r.pipeline_wall_s for i, r in ranks}
    out = {
        "pipeline_bubble_frac": sum(measured.values()) / len(ranks),
        "pipeline_bubble_frac_max": max(measured.values()),
        "pipeline_bubble_frac_analytic": sum(r.pipeline_idle_s / r.pipeline_wall_s for _, r in ranks) / len(ranks),
    }
    if len(rows) <= per_rank_up_to:
        out.update({f"pipeline_bubble_frac_rank{i}": value for i, value in measured.items()})
    return out


def checked_peak_flops(owner: str, value: object, fix: str) -> float | dict[str, float] | None:
    """``peak_flops`` as the meter keeps it: ``None``, one positive number, or positive numbers by dtype key."""
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) for k in value):
            raise TypeError(f"{owner}(peak_flops={value!r}): expected dtype keys such as 'bf16'. Fix: {fix}.")
        for key, peak in value.items():
            check_number(owner, f"peak_flops[{key!r}]", peak, fix=fix)
        return {k: float(v) for k, v in value.items()}
    check_number(owner, "peak_flops", value, allow_none=True, fix=fix)
    return None if value is None else float(value)  # type: ignore[arg-type]
