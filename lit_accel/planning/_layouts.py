"""The candidate layouts of a world: their names (``"ddp"``, ``"fsdp"``, ``"pp2"``, ``"dp2xtp2"``...) and plans.

Each name is the strategy a user would write: ``"ddp"`` is ``AccelDDP()``, ``"fsdp"`` ``AccelFSDP()``, and a product
of ``pp``/``dp``/``tp`` sizes ``AccelParallel(pipeline_parallel=..., tensor_parallel=...)`` with the data size what
the others leave (``dp`` named only beside another dimension, as in ``"pp2xdp2"``); ``"+ac"`` after a sharded name
adds ``activation_checkpointing=True``, ``"+offload"`` ``cpu_offload=True`` (both: ``"fsdp+ac+offload"``). The
plan is the strategy's own ``ParallelPlan``, built by the same checks, so a layout a strategy would refuse is refused
here with its message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lit_accel.layout.plan import ParallelPlan

__all__ = ["STRATEGIES", "Candidate", "candidates", "parse"]

_NAME = re.compile(r"^(?:pp(\d+))?x?(?:dp(\d+))?x?(?:tp(\d+))?$")
_AC = "+ac"
#: each candidate kind's strategy class (its name in ``lit_accel`` and in the strategy's messages)
STRATEGIES = {"ddp": "AccelDDP", "fsdp": "AccelFSDP", "parallel": "AccelParallel"}
#: the suffixes a sharded layout's name may end with, in this order, and the keyword each sets
_SUFFIXES = (("+offload", "cpu_offload"), (_AC, "activation_checkpointing"))


@dataclass(frozen=True)
class Candidate:
    """One layout to plan: its name, the strategy's keyword arguments, its plan or why it cannot run."""

    name: str
    #: ``"ddp"``, ``"fsdp"`` or ``"parallel"``: the strategy class (``STRATEGIES``)
    kind: str
    #: the strategy's keyword arguments (sizes; the data size is inferred)
    kwargs: dict[str, Any]
    #: the plan sized for the world (``None`` for DDP, or when refused)
    plan: ParallelPlan | None
    #: why the layout cannot run (the strategy's own message), or ``None``
    refused: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _name(pipeline: int, data: int, tensor: int) -> str:
    return "x".join(f"{dim}{n}" for dim, n in (("pp", pipeline), ("dp", data), ("tp", tensor)) if n > 1)


def parse(owner: str, name: str, world_size: int) -> Candidate:
    """The candidate ``name`` names for ``world_size`` processes.

    Raises:
        ValueError: a name that is none of ``ddp``, ``fsdp`` or a product of ``ppN``/``dpN``/``tpN``.
    """
    base, kwargs = name, dict[str, Any]()
    for suffix, keyword in _SUFFIXES:
        if base.endswith(suffix):
            base, kwargs[keyword] = base[: -len(suffix)], True
    if base == "ddp":
        what = "CPU offload" if "cpu_offload" in kwargs else "activation checkpointing"
        refused = f"{name!r}: AccelDDP has no {what}. Fix: 'fsdp{name[len(base) :]}'." if kwargs else None
        return Candidate(name, "ddp", {}, None, refused)
    kind = "fsdp" if base == "fsdp" else "parallel"
    if kind == "parallel":
        pipeline, data, tensor = _sizes(owner, name, base)
        if data > 1 and pipeline * data * tensor != world_size:
            return Candidate(name, "parallel", {}, None, f"{base} needs {pipeline * data * tensor} processes, not"
                             f" {world_size}")  # fmt: skip
        kwargs.update(pipeline_parallel=pipeline, tensor_parallel=tensor)
    try:
        plan = ParallelPlan.build(owner, world_size, **kwargs)
    except (ValueError, TypeError) as error:
        return Candidate(name, kind, kwargs, None, str(error))
    return Candidate(name, kind, kwargs, plan)


def _sizes(owner: str, name: str, base: str) -> tuple[int, int, int]:
    """The pipeline, data and tensor sizes ``base`` names (1 where it names none)."""
    match = _NAME.match(base)
    if not base or match is None or not any(match.groups()):
        raise ValueError(
            f"{owner}(layouts=[{name!r}]): not a layout name. Fix: 'ddp', 'fsdp' or sizes joined by 'x', e.g."
            " 'pp2', 'tp2', 'dp2xtp2', 'pp2xdp2', each sharded one optionally with '+ac', '+offload' or"
            " '+ac+offload'."
        )
    pipeline, data, tensor = (int(g) if g else 1 for g in match.groups())
    return pipeline, data, tensor


def candidates(owner: str, world_size: int) -> list[Candidate]:
    """Every layout of ``world_size`` processes: ``ddp``, ``fsdp``, each pipeline x tensor split (sharded ones twice).

    Each sharded layout comes again with activation checkpointing (``"+ac"``); FSDP also with CPU offload
    (``"fsdp+offload"``, ``"fsdp+ac+offload"``: the other layouts take it by name).
    """
    names = ["fsdp"]
    for pipeline in [1, *_divisors(world_size)]:
        for tensor in [1, *_divisors(world_size // pipeline)]:
            if pipeline * tensor > 1:
                names.append(_name(pipeline, world_size // (pipeline * tensor), tensor))
    names = ["ddp", *[n for name in names for n in (name, name + _AC)], "fsdp+offload", "fsdp+ac+offload"]
    return [parse(owner, name, world_size) for name in names]
