"""``lit_accel.plan``: every layout's memory per rank, predicted before launch, one row per candidate layout.

Each row holds the model state (parameters, gradients, optimizer state; ``_state.py``) and the activations of one
forward (``_activations.py``) of a layout's largest rank, through the ``ParallelPlan`` the strategies run
(``lit_accel/layout/``) and their refusals (``_layouts.py``), activation checkpointing (``"+ac"`` rows) included.
``peak_mb`` is the tensors alive at the rank's step's peak (``_peak.py``): the state, the activations held (a pipeline's
in-flight micro-batches), the step's temporaries and FSDP's gathered parameters; the runtime's own memory (kernels'
scratch, the allocator's slack) is not in it: ``fits`` keeps a headroom for it. CPU offload (``"+offload"``) moves the
state to ``host_mb`` on a GPU. The step time and the ranking by speed are the next parts. What is modelled and the
measured error: ``docs/plan.md``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lit_accel.layout.batch_plan import BatchPlan, make_batch_plan
from lit_accel.layout.chain import check_chain
from lit_accel.layout.plan import COMPUTE_DTYPES
from lit_accel.layout.stages import pipeline_units
from lit_accel.planning._activations import Activations, RankShape, measure_shape, rank_activations, shape_key
from lit_accel.planning._layouts import STRATEGIES, Candidate, candidates, parse
from lit_accel.planning._peak import Moment, StepPeak, in_children
from lit_accel.planning._state import gathered_bytes, optimizer_bytes, state_bytes, the_optimizer
from lit_accel.utilities._batches import batch_length
from lit_accel.utilities._units import format_bytes
from lit_accel.utilities._validation import check_choice, check_int, check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

    from lit_accel.layout.plan import ParallelPlan

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
    where activations are not predicted (no batch given, a tensor plan with other styles). ``peak_mb`` is the
    tensors alive at the largest rank's step's peak (by part in ``peak_parts_mb``). ``refused`` says why a layout is
    out (sizes, a strategy's guard, no room).
    """

    name: str
    #: the layout's ``ParallelPlan`` (``None`` for DDP or a refused layout)
    plan: ParallelPlan | None
    memory_mb: dict[str, float | None] = field(default_factory=dict)
    peak_mb: float | None = None
    #: whether the peak plus ``plan``'s ``headroom`` is within ``memory_per_device``; ``None`` without it (or while
    #: only the state is known and it fits)
    fits: bool | None = None
    refused: str | None = None
    kind: str = "parallel"
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``peak_mb`` by part: the state at the peak (gradients as far as they are alive), the activations held (a
    #: pipeline's in-flight micro-batches), the step's temporaries and FSDP's gathered parameters
    peak_parts_mb: dict[str, float] = field(default_factory=dict)
    #: the model state kept in host memory (CPU offload on a GPU: ``device="cuda"``), not in ``peak_mb``; else None
    host_mb: float | None = None
    #: how a step's samples are loaded and accumulated under this layout (its data-parallel ranks differ from
    #: another's): the strategy's own ``BatchPlan``; None without a batch
    batch_plan: BatchPlan | None = None

    @property
    def state_mb(self) -> float | None:
        """Parameters, gradients and optimizer state of the largest rank together (``None`` when refused)."""
        values = [self.memory_mb.get(key) for key in _STATE_KEYS]
        return None if any(v is None for v in values) else sum(values)  # type: ignore[misc]

    def strategy(self) -> Strategy:
        """The configured strategy of this layout, for ``Trainer(strategy=...)``."""
        import lit_accel  # (lit_accel imports this module)

        return getattr(lit_accel, STRATEGIES[self.kind])(**self.kwargs)


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
                 "peak_mb": r.peak_mb, "peak_parts_mb": r.peak_parts_mb, "host_mb": r.host_mb, "fits": r.fits,
                 "batch": r.batch_plan.describe() if r.batch_plan else None, "refused": r.refused}
                for r in self.rows]  # fmt: skip
        return json.dumps({"world_size": self.world_size, "precision": self.precision, "rows": rows}, indent=2)

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lit_accel.plan: {self.world_size} processes, {self.precision} (the largest rank's)")
        hosted = any(row.host_mb is not None for row in self.rows)  # CPU offload on a GPU: the state's other home
        columns = ("layout", "params", "grads", "optimizer", "activations", "peak", *(("host",) if hosted else ()),
                   "accumulate", "fits / refused")  # fmt: skip
        for column in columns:
            table.add_column(column, justify="left" if column in ("layout", "fits / refused") else "right")
        for row in self.rows:
            values = [row.memory_mb.get(k) for k in (*_STATE_KEYS, "activations_mb")] + [row.peak_mb]
            values += [row.host_mb] if hosted else []
            cells = ["-" if v is None else format_bytes(v * 1e6) for v in values]
            accumulate = "-" if row.batch_plan is None else str(row.batch_plan.accumulate_grad_batches)
            verdict = row.refused or {None: "", True: "fits", False: "no"}[row.fits]
            table.add_row(row.name, *cells, accumulate, verdict)
        out = io.StringIO()
        Console(file=out, width=160, force_terminal=False).print(table)
        return out.getvalue()


def plan(
    module: pl.LightningModule,
    batch: Any = None,
    *,
    world_size: int,
    device: str = "cpu",
    global_batch_size: int | None = None,
    memory_per_device: float | None = None,
    headroom: float = 0.1,
    precision: str = "32-true",
    layouts: Sequence[str] | None = None,
) -> Plan:
    """Every layout of ``world_size`` processes for ``module``, with its predicted memory per rank.

    ``batch``: one device's loaded batch (``None``: no activations). ``device``: where the layouts would train,
    ``"cpu"`` or ``"cuda"`` (a GPU's memory is apart from the host's: CPU offload takes the state off it into
    ``host_mb``). ``global_batch_size``: samples per optimizer step, as the strategies take it (each layout's
    accumulation in ``batch_plan``; one its data ranks and ``batch`` cannot make is refused with the strategy's
    message; ``None``: one loaded batch per data rank). ``memory_per_device``: bytes one device offers
    (a layout whose predicted peak, or state alone, exceeds it is refused). ``headroom``: the share of the predicted
    peak kept free on top of it for what is not a tensor (the runtime's buffers, the allocator's slack) and the
    prediction's error (``docs/plan.md``: up to 7% below the real footprint measured). ``layouts``: names to plan
    (default: every layout of the world: ``"ddp"``, ``"fsdp"``, ``"pp2"``, ``"tp2"``, ``"dp2xtp2"``, ..., each sharded
    one also with ``"+ac"``, FSDP also with ``"+offload"``). The module may be on the meta device: nothing is
    allocated.

    Raises:
        ValueError: a bad world size, device, global batch size, precision or layout name.
        TypeError: ``configure_optimizers`` gives no optimizer.
    """
    owner = OWNER
    check_int(owner, "world_size", world_size, example=8)
    check_choice(owner, "precision", precision, tuple(_PARAM_DTYPES), "'32-true'")
    check_choice(owner, "device", device, ("cpu", "cuda"), "'cpu' or 'cuda'")
    check_int(owner, "global_batch_size", global_batch_size, allow_none=True, example=256)
    check_number(owner, "memory_per_device", memory_per_device, allow_none=True, fix="bytes, e.g. 80e9")
    check_number(owner, "headroom", headroom, positive=False, fix="a share of the peak, e.g. 0.1")
    found = candidates(owner, world_size) if layouts is None else [parse(owner, n, world_size) for n in layouts]
    optimizer = optimizer_bytes(owner, module, world_size)
    loaded = _loaded(batch, global_batch_size)
    chain = _chain_refusal(module, found)
    admitted = [_admitted(module, candidate, precision, optimizer, chain, (world_size, global_batch_size, loaded))
                for candidate in found]  # fmt: skip
    states = [state for state, _ in admitted]
    # one fake step per rank shape, for the layouts the state left in
    plans = {shape_key(c.plan): c.plan for c, state in zip(found, states) if not isinstance(state, str)}
    shapes = dict(zip(plans, _measure(module, batch, list(plans.values()), precision)))
    offered = None if memory_per_device is None else (memory_per_device, headroom)
    rows = [_row(module, candidate, state, shapes.get(shape_key(candidate.plan)), precision, device, offered)
            for candidate, state in zip(found, states)]  # fmt: skip
    for row, (_, batch_plan) in zip(rows, admitted):
        row.batch_plan = batch_plan
        if global_batch_size is not None:  # its strategy plans the same accumulation at setup
            row.kwargs = {**row.kwargs, "global_batch_size": global_batch_size}
    return Plan(rows, world_size, precision)


def _loaded(batch: Any, global_batch_size: int | None) -> int | None:
    """The samples in one loaded ``batch`` (dim 0), or None.

    None without a batch, or for one without a shared dim 0 when there is no global batch to split (a pipeline's
    rows refuse it then, as the strategy would).
    """
    if batch is None:
        return None
    try:
        return batch_length(batch)
    except ValueError as error:
        if global_batch_size is None:
            return None
        raise ValueError(f"{OWNER}(global_batch_size={global_batch_size}): {error}") from None


def _chain_refusal(module: pl.LightningModule, found: list[Candidate]) -> str | None:
    """Why no pipeline can split ``module`` (its ``forward`` is not its units in order), or None; checked once."""
    if not any(c.plan is not None and c.plan.layout.pipeline > 1 for c in found):
        return None
    try:
        check_chain(OWNER, module, [name for name, _ in pipeline_units(module)])
    except ValueError as error:
        return str(error)
    return None


def _admitted(
    module: pl.LightningModule,
    candidate: Candidate,
    precision: str,
    optimizer: dict[str, tuple[float, float]],
    chain: str | None,
    batches: tuple[int, int | None, int | None],
) -> tuple[dict[str, float] | str, BatchPlan | None]:
    """The layout's model state and batch plan, or why it is refused (and None).

    The layout's own reasons come first (a pipeline with no ``pipeline_loss`` takes no batch at all; one of a model
    whose forward is not a chain, ``chain``), then the batch's. ``batches``: the world size, the global batch size
    and one device's loaded batch size.
    """
    state = _state(module, candidate, precision, optimizer, chain)
    if isinstance(state, str):
        return state, None
    batch_plan = _batch_plan(candidate, *batches)
    return (batch_plan, None) if isinstance(batch_plan, str) else (state, batch_plan)


def _batch_plan(candidate: Candidate, world_size: int, global_batch_size: int | None,
                loaded: int | None) -> BatchPlan | str | None:  # fmt: skip
    """The layout's ``BatchPlan`` for one device's ``loaded`` batch, or why its strategy would refuse it (or None).

    Over its data-parallel ranks (the world under DDP), split into a pipeline's micro-batches, which takes no
    accumulation.
    """
    if loaded is None or candidate.refused is not None:
        return None
    plan = candidate.plan
    ranks = world_size if plan is None else plan.layout.data
    owner = STRATEGIES[candidate.kind]
    split = {} if plan is None else plan.pipeline_split(None)
    try:
        return make_batch_plan(global_batch_size, loaded, ranks, micro_batches=split.get("micro_batches"),
                               even_micro_batches=bool(split), accumulates=not split, owner=owner)  # fmt: skip
    except ValueError as error:
        return str(error)


def _state(module: pl.LightningModule, candidate: Candidate, precision: str,
           optimizer: dict[str, tuple[float, float]], chain: str | None) -> dict[str, float] | str:  # fmt: skip
    """The layout's model state (``state_bytes``), or why it is refused (the strategy's refusals, at setup).

    Sizes, ``pipeline_loss``, ``chain`` (a forward no pipeline can split), the split, the precision.
    """
    if candidate.refused is not None:
        return candidate.refused
    try:
        if candidate.plan is not None:
            candidate.plan.check_model(OWNER, module, precision)
            if chain is not None and candidate.plan.layout.pipeline > 1:
                return chain
        return state_bytes(module, candidate.plan, _PARAM_DTYPES[precision], optimizer)
    except (ValueError, TypeError) as error:  # the split or tensor plan the strategy would refuse
        return str(error)


def _measure(module: pl.LightningModule, batch: Any, plans: list[ParallelPlan | None],
             precision: str) -> list[RankShape | str | None]:  # fmt: skip
    """Each plan's rank shape measured (``measure_shape``), or why the batch or the tensor plan refuses it."""
    if batch is None:
        return [None] * len(plans)

    def one(plan: ParallelPlan | None) -> RankShape | str | None:
        try:
            return measure_shape(module, batch, plan, precision, lambda shadow: the_optimizer(OWNER, shadow, 1))
        except (ValueError, TypeError) as error:  # a batch a pipeline cannot split, heads a tensor size cannot
            return str(error)

    # fake tensors, once used, make this process's next real backward start autograd's device threads, after which
    # no forked child can train (Lightning's fork start methods): the fake work runs in children of its own
    return in_children(one, plans)


def _row(module: pl.LightningModule, candidate: Candidate, state: dict[str, float] | str,
         shape: RankShape | str | None, precision: str, device: str,
         offered: tuple[float, float] | None) -> PlanRow:  # fmt: skip
    row = PlanRow(candidate.name, candidate.plan, kind=candidate.kind, kwargs=candidate.kwargs)
    if isinstance(state, str) or isinstance(shape, str):
        row.refused = state if isinstance(state, str) else shape
        return row
    row.memory_mb = {f"{key}_mb": value / 1e6 for key, value in state.items()}
    row.memory_mb["activations_mb"] = None  # until a batch's step is measured
    # a GPU's memory is apart from the host's, where CPU offload keeps the state
    offloaded = candidate.plan is not None and candidate.plan.cpu_offload and device != "cpu"
    row.host_mb = sum(state.values()) / 1e6 if offloaded else None
    if shape is not None:
        held = rank_activations(candidate.plan, shape)
        row.memory_mb["activations_mb"] = held.per_micro_batch / 1e6
        parts = _peak_parts(module, candidate.plan, row.kind, state, held, shape.step, precision, offloaded)
        row.peak_parts_mb = {key: value / 1e6 for key, value in parts.items()}
        row.peak_mb = sum(row.peak_parts_mb.values())
    if offered is not None:
        _judge(row, *_least_on_device(module, candidate.plan, state, row.peak_mb, precision, offloaded), *offered)
    return row


def _least_on_device(module: pl.LightningModule, plan: ParallelPlan | None, state: dict[str, float],
                     peak_mb: float | None, precision: str, offloaded: bool) -> tuple[float, str]:  # fmt: skip
    """The bytes a device needs at least, and what they are: the predicted peak, else a lower bound of it."""
    if peak_mb is not None:
        return peak_mb * 1e6, "the predicted peak"
    if offloaded:  # the state is in host memory; FSDP still gathers the parameters on the device
        dtype = COMPUTE_DTYPES.get(precision, _PARAM_DTYPES[precision])
        return gathered_bytes(module, plan, state["params"], dtype), "the gathered parameters alone"
    return sum(state.values()), "the model state alone"


def _judge(row: PlanRow, known: float, what: str, memory: float, headroom: float) -> None:
    """``row.fits`` (and the refusal) for ``known`` bytes with ``headroom`` on top against ``memory`` offered."""
    needed = known * (1 + headroom)
    if row.peak_mb is not None or needed > memory:  # a lower bound fitting says nothing of the peak
        row.fits = needed <= memory
    if row.fits is False:
        row.refused = (f"{what} takes {known / 1e6:.1f} MB per device, {needed / 1e6:.1f} MB with the"
                       f" {headroom:.0%} headroom, {memory / 1e6:.1f} MB offered")  # fmt: skip


def _peak_parts(module: pl.LightningModule, plan: ParallelPlan | None, kind: str, state: dict[str, float],
                activations: Activations, step: StepPeak, precision: str,
                offloaded: bool) -> dict[str, float]:  # fmt: skip
    """The largest rank's bytes at its step's peak, by part (``PlanRow.peak_parts_mb``): the larger of its moments.

    ``offloaded``: the state in host memory, apart from the device's (CPU offload on a GPU); the optimizer steps
    there too, so the device's largest moment is the computing one, with the gradients FSDP reduces before it moves
    them.
    """
    pipeline = plan is not None and plan.layout.pipeline > 1
    gathered_dtype = COMPUTE_DTYPES.get(precision, _PARAM_DTYPES[precision])
    gathered = gathered_bytes(module, plan, state["params"], gathered_dtype)

    def parts(moment: Moment, computing: bool) -> dict[str, float]:
        # a pipeline's stages hold their in-flight micro-batches while computing; elsewhere (and after) what the
        # fake step still held
        held = activations.held if pipeline and computing else min(activations.held, moment.activations)
        # AccelDDP's gradients are views of DDP's buckets, allocated at setup; a pipeline's accumulate over its
        # micro-batches; elsewhere they come with the backward
        grads = state["grads"] if kind == "ddp" or pipeline else state["grads"] * moment.grads
        if offloaded and not computing:
            return dict.fromkeys(("params", "grads", "optimizer", "activations", "temporaries", "gathered"), 0.0)
        return {"params": 0.0 if offloaded else state["params"], "grads": grads,
                "optimizer": 0.0 if offloaded else state["optimizer"], "activations": held,
                "temporaries": moment.temporaries, "gathered": gathered if computing else 0.0}  # fmt: skip

    # FSDP's parameters are gathered while the step computes, resharded when the optimizer updates
    return max(parts(step.compute, True), parts(step.update, False), key=lambda found: sum(found.values()))
