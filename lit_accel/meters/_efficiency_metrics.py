"""The arithmetic of :class:`~lit_accel.meters.EfficiencyMeter`: per-rank window numbers in, named metrics out.

Pure Python, so every formula is tested with exact numbers. ``W`` is a window's wall-clock (slowest rank), ``n`` the
world size, ``S`` the samples of all ranks, ``k`` the optimizer steps. Sources of the formulas: ``docs/monitors.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["EfficiencyConfig", "RankWindow", "window_metrics"]


@dataclass
class RankWindow:
    """One rank's numbers for one logging window (or, accumulated, for the whole run)."""

    window_s: float = 0.0
    samples: float = 0.0
    items: float = 0.0
    steps: float = 0.0
    data_wait_s: float = 0.0
    busy_s: float = 0.0
    peak_memory_bytes: float = 0.0
    flops: float = 0.0
    comm_bytes: float = 0.0
    comm_bus_bytes: float = 0.0
    comm_s: float = 0.0

    def vector(self) -> list[float]:
        """The fields in declaration order, for one collective."""
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> RankWindow:
        """Inverse of :meth:`vector`."""
        return cls(*values)

    def accumulate(self, other: RankWindow) -> None:
        """Add ``other`` into this total (peak memory: the maximum)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "peak_memory_bytes" else mine + theirs)


@dataclass
class EfficiencyConfig:
    """What the metrics need besides the windows."""

    flops_per_sample: float | None = None
    peak_flops: float | None = None
    baseline_samples_per_sec: float | None = None
    cuda: bool = False


def window_metrics(
    rows: list[RankWindow], window_s: float, config: EfficiencyConfig, has_comm: bool
) -> tuple[dict[str, float], float | None]:
    """Metrics of one window (or the whole run) from every rank's row, and the FLOP/s if MFU would exceed 1.

    Returns ``({}, None)`` for an empty window.
    """
    n = len(rows)
    steps = rows[0].steps
    if window_s <= 0 or steps <= 0:
        return {}, None
    samples = sum(r.samples for r in rows)
    per_device = samples / window_s / n
    out = {
        "samples_per_sec": samples / window_s,
        "samples_per_sec_per_device": per_device,
        "items_per_sec": sum(r.items for r in rows) / window_s,
        "step_time_ms": 1e3 * window_s / steps,
        "data_wait_frac": sum(r.data_wait_s / r.window_s for r in rows if r.window_s > 0) / n,
    }
    mfu_excess = None
    if config.flops_per_sample is not None:
        flops_per_device_s = sum(r.flops for r in rows) / window_s / n
        out["tflops_per_device"] = flops_per_device_s / 1e12
        if config.peak_flops is not None:
            mfu = flops_per_device_s / config.peak_flops
            if mfu <= 1.0:
                out["mfu"] = mfu
            else:
                mfu_excess = flops_per_device_s  # never logged above 1: the peak (or the FLOP count) is wrong
    if config.cuda:
        out["peak_memory_gb"] = max(r.peak_memory_bytes for r in rows) / 1e9
    busy = [r.busy_s for r in rows]
    if n > 1 and min(busy) > 0:
        out["step_time_spread"] = max(busy) / min(busy)
    if config.baseline_samples_per_sec is not None:
        out["scaling_efficiency"] = per_device / config.baseline_samples_per_sec
    comm_bytes, comm_s = sum(r.comm_bytes for r in rows) / n, sum(r.comm_s for r in rows) / n
    if has_comm and comm_bytes > 0:
        out["comm_gb_per_step"] = comm_bytes / steps / 1e9
        if comm_s > 0 and n > 1:
            # nccl-tests' bus bandwidth: the bytes the ring algorithms move per rank, over the time.
            out["comm_busbw_gbps"] = sum(r.comm_bus_bytes for r in rows) / n / comm_s / 1e9
            out["comm_time_frac"] = sum(r.comm_s / r.window_s for r in rows if r.window_s > 0) / n
    return out, mfu_excess
