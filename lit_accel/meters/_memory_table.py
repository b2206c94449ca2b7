"""The end-of-fit table of :class:`~lit_accel.meters.MemoryMeter`, rendered with ``rich``.

Bytes by category (the largest rank's, with its dtype split and unsharded size), then what each lever (sharding,
autocast) saved per rank where one run tells. Under a pipeline, a second table: each stage's largest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lit_accel.meters._memory_metrics import DtypeBytes, RankMemory
from lit_accel.utilities._units import format_bytes, format_count

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["memory_table", "stage_table"]

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
