"""End-of-fit tables of the meters, rendered with ``rich`` (the callbacks print them; raw loops can too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["efficiency_table"]

# (label, key, format) in display order; rows whose key is absent are left out.
_EFFICIENCY_ROWS = (
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
    ("gradient comm GB per step", "comm_gb_per_step", "{:.4f}"),
    ("comm bus bandwidth (GB/s)", "comm_busbw_gbps", "{:,.2f}"),
    ("comm in flight (% of step)", "comm_time_frac", "{:.1%}"),
    ("measured optimizer steps", "measured_steps", "{:.0f}"),
)


def efficiency_table(summary: dict[str, float], title: str) -> Table:
    """The ``EfficiencyMeter.summary()`` averages as a two-column table."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("average", justify="right")
    for label, key, fmt in _EFFICIENCY_ROWS:
        if key in summary:
            table.add_row(label, fmt.format(summary[key]))
    return table
