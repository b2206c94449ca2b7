"""The arithmetic of :class:`~lit_accel.meters.MemoryMeter`: per-rank byte counts in, named metrics out.

Pure Python, so every formula is tested with exact numbers. MB = 1e6 bytes (``lit_accel/utilities/_units.py``).
Formulas and the meaning of each key: ``docs/monitors.md`` (MemoryMonitor).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["DTYPE_SLOTS", "DtypeBytes", "RankMemory", "lever_savings", "memory_metrics", "per_stage", "stage_metrics"]

#: The dtype split of every category, in vector order ("fp8": any float8 format; "other": ints, bools, complex...).
DTYPE_SLOTS = ("fp32", "bf16", "fp16", "fp8", "fp64", "other")
_HALF = ("bf16", "fp16")


@dataclass
class DtypeBytes:
    """Bytes of one category on one rank, split by dtype."""

    fp32: float = 0.0
    bf16: float = 0.0
    fp16: float = 0.0
    fp8: float = 0.0
    fp64: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        """All dtypes together."""
        return sum(getattr(self, slot) for slot in DTYPE_SLOTS)

    def add(self, slot: str, nbytes: float) -> None:
        """Book ``nbytes`` under ``slot`` (one of :data:`DTYPE_SLOTS`)."""
        setattr(self, slot, getattr(self, slot) + nbytes)

    def nonzero(self) -> dict[str, float]:
        """``{slot: bytes}`` of the dtypes present, in :data:`DTYPE_SLOTS` order."""
        return {slot: getattr(self, slot) for slot in DTYPE_SLOTS if getattr(self, slot)}


@dataclass
class RankMemory:
    """One rank's memory, as one vector for one collective.

    ``*_unsharded`` are the bytes the same tensors would take unsharded (their global shape: equal to the local total
    without sharding). ``param_casts`` are the saved low-precision copies of parameters (autocast's per-op casts),
    kept out of ``activations``. ``state_recorded`` and ``activations_measured`` are 0/1 flags.
    """

    params: DtypeBytes = field(default_factory=DtypeBytes)
    grads: DtypeBytes = field(default_factory=DtypeBytes)
    optimizer: DtypeBytes = field(default_factory=DtypeBytes)
    activations: DtypeBytes = field(default_factory=DtypeBytes)
    param_casts: float = 0.0
    params_unsharded: float = 0.0
    grads_unsharded: float = 0.0
    optimizer_unsharded: float = 0.0
    state_recorded: float = 0.0
    activations_measured: float = 0.0
    peak_allocated: float = 0.0
    peak_reserved: float = 0.0
    alloc_retries: float = 0.0
    ooms: float = 0.0

    def vector(self) -> list[float]:
        """Every number in declaration order (a :class:`DtypeBytes` as its :data:`DTYPE_SLOTS`)."""
        out: list[float] = []
        for f in fields(self):
            value = getattr(self, f.name)
            out += [getattr(value, s) for s in DTYPE_SLOTS] if isinstance(value, DtypeBytes) else [value]
        return out

    @classmethod
    def from_vector(cls, values: list[float]) -> RankMemory:
        """Inverse of :meth:`vector`."""
        row, i = cls(), 0
        for f in fields(row):
            if isinstance(getattr(row, f.name), DtypeBytes):
                setattr(row, f.name, DtypeBytes(*values[i : i + len(DTYPE_SLOTS)]))
                i += len(DTYPE_SLOTS)
            else:
                setattr(row, f.name, values[i])
                i += 1
        return row

    def as_dict(self) -> dict[str, Any]:
        """For the JSON report: categories as ``{"total": ..., "by_dtype": {...}}``, bytes throughout."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, DtypeBytes):
                value = {"total": value.total, "by_dtype": value.nonzero()}
            out[f.name] = value
        return out


def _put(out: dict[str, float], name: str, per_rank: list[float]) -> None:
    """``{name}_mb``: the maximum over ranks; ``{name}_spread``: max / min, where ranks differ and none is 0."""
    high, low = max(per_rank), min(per_rank)
    out[f"{name}_mb"] = high / 1e6
    if high != low and low > 0:
        out[f"{name}_spread"] = high / low


def memory_metrics(rows: list[RankMemory], cuda: bool) -> dict[str, float]:
    """The logged metrics (without prefix) from every rank's row; categories not measured yet are left out."""
    out: dict[str, float] = {}
    for flag, names in _MEASURED_TOGETHER:
        if all(getattr(r, flag) for r in rows):
            for name in names:
                _put(out, name, [_total(getattr(r, name)) for r in rows])
    if cuda:
        for name in ("peak_allocated", "peak_reserved"):
            _put(out, name, [getattr(r, name) for r in rows])
        for name in ("alloc_retries", "ooms"):  # counters: the largest, no spread
            out[name] = max(getattr(r, name) for r in rows)
    return out


#: Categories reported once every rank's flag says they were measured, in the logged order.
_MEASURED_TOGETHER = (("state_recorded", ("params", "grads", "optimizer")),
                      ("activations_measured", ("activations", "param_casts")))  # fmt: skip


def _total(value: DtypeBytes | float) -> float:
    return value.total if isinstance(value, DtypeBytes) else value


def per_stage(rows: list[RankMemory], stages: list[int | None], cuda: bool) -> dict[int, dict[str, float]]:
    """Per stage label (ascending): the ``*_mb`` metrics over the ranks with that label; empty unless all have one."""
    labels = [stage for stage in stages if stage is not None]
    if not labels or len(labels) < len(stages):
        return {}
    out: dict[int, dict[str, float]] = {}
    for stage in sorted(set(labels)):
        group = [row for row, label in zip(rows, labels) if label == stage]
        out[stage] = {k: v for k, v in memory_metrics(group, cuda).items() if k.endswith("_mb")}
    return out


def stage_metrics(rows: list[RankMemory], stages: list[int | None], cuda: bool) -> dict[str, float]:
    """``stage{k}/<name>_mb``: :func:`per_stage` flattened into logged keys."""
    stages_metrics = per_stage(rows, stages, cuda)
    return {f"stage{k}/{name}": v for k, metrics in stages_metrics.items() for name, v in metrics.items()}


def lever_savings(rows: list[RankMemory]) -> dict[str, float]:
    """What sharding and autocast saved per rank (the maximum over ranks), in MB, where one run tells.

    Sharding: unsharded - local bytes of parameters, gradients and optimizer state. Autocast: a bf16/fp16 saved
    activation would be twice as large in fp32, so it saved its own size (an estimate: in fp32 some of these would
    be the same storage as a neighbouring op's); its parameter copies cost ``param_casts``.
    """
    out: dict[str, float] = {}
    if all(r.state_recorded for r in rows):
        for name in ("params", "grads", "optimizer"):
            out[f"{name}_unsharded_mb"] = max(getattr(r, f"{name}_unsharded") for r in rows) / 1e6
        saved = [
            sum(getattr(r, f"{n}_unsharded") - getattr(r, n).total for n in ("params", "grads", "optimizer"))
            for r in rows
        ]
        out["sharding_saved_mb"] = max(saved) / 1e6
    if all(r.activations_measured for r in rows):
        half = [sum(getattr(r.activations, s) for s in _HALF) for r in rows]
        out["activations_fp32_equivalent_mb"] = max(r.activations.total + h for r, h in zip(rows, half)) / 1e6
        out["autocast_saved_mb"] = max(half) / 1e6
    return out
