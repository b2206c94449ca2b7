"""End-of-fit tables of the meters, rendered with ``rich`` (the callbacks print them; raw loops can too).

The efficiency table (throughput, step time and its parts, MFU, stragglers) and the memory table (bytes by category,
the largest rank's, with its dtype split and unsharded size, then what each lever, sharding or autocast, saved per rank
where one run tells; under a pipeline a second one, each stage's largest rank). Numbers carry the unit their magnitude
calls for (``lit_accel/utilities/_units.py``): a CPU run reads "3.21 GFLOP/s", not "0.00 TFLOP/s", and "512 kB", not
"0.0005 GB".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lit_accel.meters._memory_metrics import DtypeBytes, RankMemory
from lit_accel.utilities._units import (
    format_bytes,
    format_count,
    format_flops_per_second,
    format_percent,
    format_seconds,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["comm_note", "efficiency_table", "memory_table", "peaks_caption", "stage_table"]


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


# (label, RankMemory field, its unsharded field or None, summary key) in display order.
_CATEGORIES = (
    ("parameters", "params", "params_unsharded", "params"),
    ("gradients", "grads", "grads_unsharded", "grads"),
    ("optimizer state", "optimizer", "optimizer_unsharded", "optimizer"),
    ("activations (1 batch)", "activations", None, "activations"),
    ("autocast weight copies", "param_casts", None, "param_casts"),
    ("peak allocated (CUDA)", "peak_allocated", None, "peak_allocated"),
    ("peak reserved (CUDA)", "peak_reserved", None, "peak_reserved"),
)


def _bytes_of(row: RankMemory, name: str) -> float:
    value = getattr(row, name)
    return value.total if isinstance(value, DtypeBytes) else value


def _by_dtype(row: RankMemory, name: str) -> str:
    value = getattr(row, name)
    if not isinstance(value, DtypeBytes):
        return ""
    return ", ".join(f"{slot} {format_bytes(n)}" for slot, n in value.nonzero().items())


def _add_category(table: Table, rows: list[RankMemory], summary: dict[str, float], label: str, name: str,
                  unsharded: str | None, key: str) -> None:  # fmt: skip
    """One category's row: the largest rank's bytes, its dtype split, the unsharded size and the spread."""
    if not summary.get(f"{key}_mb") and (name == "param_casts" or f"{key}_mb" not in summary):
        return  # not measured, or no autocast
    largest = max(rows, key=lambda r: _bytes_of(r, name))
    spread = summary.get(f"{key}_spread")
    table.add_row(
        label,
        format_bytes(_bytes_of(largest, name)),
        _by_dtype(largest, name),
        format_bytes(getattr(largest, unsharded)) if unsharded else "",
        f"{spread:.3f}" if spread is not None else "",
    )


def memory_table(rows: list[RankMemory], summary: dict[str, float], title: str) -> Table:
    """Per category the largest rank's bytes, its dtype split, the unsharded size and the spread; then the levers."""
    from rich.table import Table

    table = Table(title=title, caption="activation checkpointing's saving needs two runs: benchmarks/memory.py")
    for column in ("memory", "per rank (max)", "by dtype", "unsharded", "spread"):
        table.add_column(column, justify="left" if column in ("memory", "by dtype") else "right")
    for category in _CATEGORIES:
        _add_category(table, rows, summary, *category)
    for label, key in (("allocator retries (CUDA)", "alloc_retries"), ("OOMs (CUDA)", "ooms")):
        if key in summary:
            table.add_row(label, format_count(summary[key]), "", "", "")
    levers = _levers(summary)
    if levers:
        table.add_section()
    for lever, saved in levers:
        table.add_row(lever, saved, "", "", "")
    return table


def _levers(summary: dict[str, float]) -> list[tuple[str, str]]:
    out = []
    if summary.get("sharding_saved_mb"):
        out.append(("saved by sharding (params, grads, state)", format_bytes(summary["sharding_saved_mb"] * 1e6)))
    if summary.get("autocast_saved_mb"):
        fp32 = format_bytes(summary["activations_fp32_equivalent_mb"] * 1e6)
        out.append((f"saved by autocast (est.; fp32: {fp32})", format_bytes(summary["autocast_saved_mb"] * 1e6)))
    return out


def stage_table(per_stage: list[dict[str, Any]], held: Sequence[Sequence[int]] = ()) -> Table:
    """One row per stage label (the report's ``per_stage``): each category's largest rank among that stage's ranks.

    ``held[k]``: the stages the ranks labelled ``k`` hold (``StagePlacement.stages``), shown instead of ``k``.
    """
    from rich.table import Table

    shown = [(label, key) for label, _, _, key in _CATEGORIES if any(s.get(f"{key}_mb") for s in per_stage)]
    table = Table(title="memory per pipeline stage (largest rank of each)")
    table.add_column("stages" if any(len(h) > 1 for h in held) else "stage")
    table.add_column("ranks", justify="right")
    for label, _ in shown:
        table.add_column(label, justify="right")
    for entry in per_stage:
        stage = entry["stage"]
        name = ", ".join(map(str, held[stage])) if stage < len(held) else str(stage)
        cells = [format_bytes(entry.get(f"{key}_mb", 0.0) * 1e6) for _, key in shown]
        table.add_row(name, format_count(len(entry["ranks"])), *cells)
    return table
