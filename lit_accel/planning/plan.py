"""``lit_accel.plan``: every layout's memory per rank, predicted before launch, one row per candidate layout.

Each row holds the model state (parameters, gradients, optimizer state; ``_state.py``) and the activations of one
forward (``_activations.py``) of a layout's largest rank, through the strategies' own plans and refusals
(``_layouts.py``), activation checkpointing (``"+ac"`` rows) included. ``peak_mb`` is their sum (transient buffers,
FSDP's gathered blocks and the allocator's slack are not modelled yet); CPU offload, the step time and the ranking by
speed are the next parts. What is modelled and the measured error: ``docs/plan.md``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lit_accel.planning._activations import activation_bytes
from lit_accel.planning._layouts import Candidate, candidates, parse
from lit_accel.planning._state import optimizer_bytes, state_bytes
from lit_accel.strategies.sharded._checks import check_pipeline_loss
from lit_accel.utilities._units import format_bytes
from lit_accel.utilities._validation import check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

    from lit_accel.strategies.sharded.plan import ParallelPlan

__all__ = ["Plan", "PlanRow", "plan"]

_PARAM_DTYPES = {"32-true": torch.float32, "32": torch.float32, "64-true": torch.float64, "bf16-true": torch.bfloat16,
                 "16-true": torch.float16, "bf16-mixed": torch.float32, "16-mixed": torch.float32,
                 "fp8-mixed": torch.float32}  # fmt: skip
_STATE_KEYS = ("params_mb", "grads_mb", "optimizer_mb")
OWNER = "lit_accel.plan"


@dataclass
class PlanRow:
    """One candidate layout: its plan, its predicted memory per rank (the largest rank's), and whether it can run.

    ``memory_mb`` has the ``MemoryMonitor``'s keys (``params_mb``, ``grads_mb``, ``optimizer_mb``,
    ``activations_mb``; MB = 1e6 bytes), each the maximum over ranks; ``activations_mb`` and ``peak_mb`` are ``None``
    where activations are not predicted (no batch given, tensor parallel). ``refused`` says why a layout is out
    (sizes, a strategy's guard, no room).
    """

    name: str
    #: the layout's ``ParallelPlan`` (``None`` for DDP or a refused layout)
    plan: ParallelPlan | None
    memory_mb: dict[str, float | None] = field(default_factory=dict)
    peak_mb: float | None = None
    #: ``None`` without ``memory_per_device`` (or while only the state is known and it fits)
    fits: bool | None = None
    refused: str | None = None
    kind: str = "parallel"
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def state_mb(self) -> float | None:
        """Parameters, gradients and optimizer state of the largest rank together (``None`` when refused)."""
        values = [self.memory_mb.get(key) for key in _STATE_KEYS]
        return None if any(v is None for v in values) else sum(values)  # type: ignore[misc]

    def strategy(self) -> Strategy:
        """The configured strategy of this layout, for ``Trainer(strategy=...)``."""
        from lit_accel import AccelDDP, AccelFSDP, AccelParallel

        if self.kind == "ddp":
            return AccelDDP()
        if self.kind == "fsdp":
            return AccelFSDP(**self.kwargs)
        return AccelParallel(**self.kwargs)


class Plan:
    """The rows of :func:`plan`: ``plan["dp2xtp2"]``, ``plan.best``, ``print(plan)`` (a table), ``plan.to_json()``."""

    def __init__(self, rows: list[PlanRow], world_size: int, precision: str) -> None:
        self.rows = rows
        self.world_size = world_size
        self.precision = precision

    def __getitem__(self, name: str) -> PlanRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"plan has no layout {name!r}. Fix: one of {[row.name for row in self.rows]}.")

    @property
    def best(self) -> PlanRow | None:
        """The runnable row with the least memory (the state's until activations are predicted), or None."""
        runnable = [row for row in self.rows if row.refused is None and row.fits is not False]
        return min(runnable, key=lambda row: row.peak_mb or row.state_mb or 0.0, default=None)

    def to_json(self) -> str:
        """The report: world, precision and every row (its plan as ``describe()``)."""
        rows = [{"name": r.name, "plan": r.plan.describe() if r.plan else None, "memory_mb": r.memory_mb,
                 "peak_mb": r.peak_mb, "fits": r.fits, "refused": r.refused} for r in self.rows]  # fmt: skip
        return json.dumps({"world_size": self.world_size, "precision": self.precision, "rows": rows}, indent=2)

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lit_accel.plan: {self.world_size} processes, {self.precision} (the largest rank's)")
        for column in ("layout", "params", "grads", "optimizer", "activations", "peak", "fits / refused"):
            table.add_column(column, justify="left" if column in ("layout", "fits / refused") else "right")
        for row in self.rows:
            values = [row.memory_mb.get(k) for k in (*_STATE_KEYS, "activations_mb")] + [row.peak_mb]
            cells = ["-" if v is None else format_bytes(v * 1e6) for v in values]
            verdict = row.refused or {None: "", True: "fits", False: "no"}[row.fits]
            table.add_row(row.name, *cells, verdict)
        out = io.StringIO()
        Console(file=out, width=160, force_terminal=False).print(table)
        return out.getvalue()


def plan(
    module: pl.LightningModule,
    batch: Any = None,
    *,
    world_size: int,
    memory_per_device: float | None = None,
    precision: str = "32-true",
    layouts: Sequence[str] | None = None,
) -> Plan:
    """Every layout of ``world_size`` processes for ``module``, with its predicted memory per rank.

    ``batch``: one device's loaded batch (``None``: no activations). ``memory_per_device``: bytes one device offers
    (a layout whose predicted peak, or state alone, exceeds it is refused). ``layouts``: names to plan (default: every
    layout of the world: ``"ddp"``, ``"fsdp"``, ``"pp2"``, ``"tp2"``, ``"dp2xtp2"``, ..., each sharded one also with
    ``"+ac"``). The module may be on the meta device: nothing is allocated.

    Raises:
        ValueError: a bad world size, precision or layout name. TypeError: ``configure_optimizers`` gives no optimizer.
    """
    owner = OWNER
    check_int(owner, "world_size", world_size, example=8)
    check_choice(owner, "precision", precision, tuple(_PARAM_DTYPES), "'32-true'")
    found = candidates(owner, world_size) if layouts is None else [parse(owner, n, world_size) for n in layouts]
    optimizer = optimizer_bytes(owner, module, world_size)
    rows = [_row(module, batch, candidate, precision, optimizer, memory_per_device) for candidate in found]
    return Plan(rows, world_size, precision)


def _row(module: pl.LightningModule, batch: Any, candidate: Candidate, precision: str,
         optimizer: dict[str, tuple[float, float]], memory_per_device: float | None) -> PlanRow:  # fmt: skip
    row = PlanRow(candidate.name, candidate.plan, refused=candidate.refused, kind=candidate.kind,
                  kwargs=candidate.kwargs)  # fmt: skip
    if row.refused is not None:
        return row
    try:
        if candidate.plan is not None:
            check_pipeline_loss(OWNER, module, candidate.plan.layout.pipeline)
        state = state_bytes(module, candidate.plan, _PARAM_DTYPES[precision], optimizer)
        activations = activation_bytes(module, batch, candidate.plan, precision)
    except (ValueError, TypeError) as error:  # the split or tensor plan the strategy would refuse
        row.refused = str(error)
        return row
    row.memory_mb = {f"{key}_mb": value / 1e6 for key, value in state.items()}
    row.memory_mb["activations_mb"] = None if activations is None else activations / 1e6
    known = sum(state.values()) + (activations or 0.0)
    row.peak_mb = None if activations is None else known / 1e6
    if memory_per_device is not None and (activations is not None or known > memory_per_device):
        row.fits = known <= memory_per_device
        if not row.fits:
            what = "the predicted peak" if activations is not None else "the model state alone"
            row.refused = f"{what} takes {known / 1e6:.1f} MB per device, {memory_per_device / 1e6:.1f} MB offered"
    return row
