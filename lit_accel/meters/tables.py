"""End-of-fit tables of the meters, rendered with ``rich`` (the callbacks print them; raw loops can too).

Numbers carry the unit their magnitude calls for (``lit_accel/utilities/_units.py``): a CPU run reads "3.21 GFLOP/s",
not "0.00 TFLOP/s", and "512 kB", not "0.0005 GB".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lit_accel.utilities._units import (
    format_bytes,
    format_count,
    format_flops_per_second,
    format_percent,
    format_seconds,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["comm_note", "efficiency_table", "peaks_caption"]


def _per_second(text: str) -> str:
    return f"{text}/s"


# (label, key, formatter) in display order; rows whose key is absent are left out.
_EFFICIENCY_ROWS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("samples/s (global)", "samples_per_sec", lambda v: format_count(v, 1)),
    ("samples/s per device", "samples_per_sec_per_device", lambda v: format_count(v, 1)),
    ("items/s (global)", "items_per_sec", lambda v: format_count(v, 1)),
    ("step time", "step_time_ms", lambda v: format_seconds(v / 1e3)),
    ("data wait (share of step)", "data_wait_frac", format_percent),
    ("FLOP/s per device", "tflops_per_device", lambda v: format_flops_per_second(v * 1e12)),
    ("MFU", "mfu", format_percent),
    ("peak memory", "peak_memory_gb", lambda v: format_bytes(v * 1e9)),
    ("straggler spread (max/min busy)", "step_time_spread", "{:.3f}".format),
    ("scaling efficiency", "scaling_efficiency", format_percent),
    ("gradient comm per step", "comm_gb_per_step", lambda v: format_bytes(v * 1e9)),
    ("comm bus bandwidth", "comm_busbw_gbps", lambda v: _per_second(format_bytes(v * 1e9))),
    ("comm in flight (share of step)", "comm_time_frac", format_percent),
    ("comm exposed (share of step)", "comm_exposed_frac", format_percent),
    ("compute / (compute + exposed comm)", "compute_frac", format_percent),
    ("straggler", "straggler_rank", lambda v: "none" if v < 0 else f"rank {v:.0f}"),
    ("slowest rank's own time above the others'", "straggler_excess_frac", format_percent),
    ("torch.compile recompilations", "recompiles", format_count),
    ("measured optimizer steps", "measured_steps", format_count),
)


def efficiency_table(
    summary: dict[str, float], title: str, caption: str | None = None, comm_note: str | None = None
) -> Table:
    """The ``EfficiencyMeter.summary()`` averages as a two-column table (``caption``: e.g. :func:`peaks_caption`).

    ``comm_note`` says why the communication rows are missing (:func:`comm_note`); shown only when they are.
    """
    from rich.table import Table

    table = Table(title=title, caption=caption)
    table.add_column("metric")
    table.add_column("average", justify="right")
    for label, key, fmt in _EFFICIENCY_ROWS:
        if key in summary:
            table.add_row(label, fmt(summary[key]))
        elif key == "comm_gb_per_step" and comm_note is not None:
            table.add_row("gradient comm", comm_note)
    return table


def comm_note(strategy: str, world_size: int, has_comm_stats: bool) -> str | None:
    """Why a run's table has no communication rows, or ``None`` when it should have them (or one rank has none)."""
    if world_size < 2 or has_comm_stats:
        return None
    return f"not measured: {strategy} counts no collectives (no comm_stats); AccelDDP and AccelFSDP do"


def peaks_caption(config: Mapping[str, Any]) -> str:
    """Which peaks MFU used and why, from a report's ``config``: the table entry or ``peak_flops``, per dtype run."""
    peaks = config.get("peak_flops")
    if peaks is None:
        return f"no MFU: {config.get('peak_reason') or 'no peak FLOP/s'}. Fix: pass peak_flops=."
    split = config.get("flops_by_dtype") or {config.get("precision", "fp32"): config.get("flops_per_sample") or 0}
    ran = sorted(d for d, f in split.items() if f)
    if isinstance(peaks, Mapping):
        figures = ", ".join(f"{d} {format_flops_per_second(peaks[d])}" if d in peaks else f"{d} none" for d in ran)
    else:
        figures = format_flops_per_second(float(peaks))
    source = f"table entry {config['peak_entry']!r}" if config.get("peak_entry") else "peak_flops"
    return f"MFU peaks: {figures} ({source}; {config.get('peak_reason', '')})"
