"""The pipeline contract, checked: the model's ``forward`` must be its units applied in order, or no split is made.

A pipeline runs the units of the model in registration order (``layout.stages.StageModule``), never the model's own
``forward``; a residual across units, an operation between them or units called in another order would then train a
different model without a word. Before the split, ``forward`` is traced with ``torch.fx`` (units as leaves: nothing
runs, so a model on the meta device is checked as well) and every node must be a unit taking the previous unit's
output (or the items of its tuple), the first taking the inputs, the output the last unit's. The same deterministic
check runs on every rank, so every rank refuses together, before any collective. A forward that cannot be traced is
refused too: an unverified split never trains.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch import nn

from lit_accel.layout.stages import CONTAINERS

__all__ = ["check_chain"]


class _UnitTracer(fx.Tracer):
    """Traces ``forward`` with every unit a leaf (containers traced through)."""

    def __init__(self, units: set[str]) -> None:
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.units:
            return True
        return not isinstance(m, CONTAINERS) and super().is_leaf_module(m, module_qualified_name)


def _fix(names: list[str]) -> str:
    return (
        f"Fix: make forward apply the units in registration order ({', '.join(names)}), each on the previous one's"
        " output; fold a residual, an activation or any operation between units into a unit (a module whose forward"
        " does both), or train without pipeline_parallel."
    )


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"unit {node.target!r}"
    target = getattr(node.target, "__name__", str(node.target))
    sources = [arg.name for arg in node.all_input_nodes]
    return f"{target!r} (of {', '.join(sources) or 'constants'})"


def check_chain(owner: str, module: nn.Module, names: list[str]) -> None:
    """Refuse a model whose ``forward`` is not the units ``names`` applied in order (``ValueError``)."""
    try:
        graph = _UnitTracer(set(names)).trace(module)
    except Exception as err:  # any failure to trace: the chain cannot be verified
        raise ValueError(
            f"{owner}: the model's forward cannot be traced to check that it applies its units in order"
            f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}), and a pipeline split of an"
            f" unverified forward could train a different model. {_fix(names)}"
        ) from err
    problem = _first_break(graph, names)
    if problem is not None:
        raise ValueError(
            f"{owner}: the model's forward is not its units applied in order, so a pipeline split would train a"
            f" different model: {problem}. {_fix(names)}"
        )


def _first_break(graph: fx.Graph, names: list[str]) -> str | None:
    """What first departs from the chain of ``names``, or None."""
    calls = [node for node in graph.nodes if node.op == "call_module"]
    called = [str(node.target) for node in calls]
    if called != names:
        return _order_break(called, names)
    inputs = tuple(node for node in graph.nodes if node.op == "placeholder")
    previous: fx.Node | None = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr") or _is_item_of(node, previous):
            continue
        if node.op == "output":
            result = node.args[0]
            return None if result is previous else f"forward returns {_returned(result)}, not the last unit's output"
        problem = _link_break(node, previous, inputs)
        if problem is not None:
            return problem
        previous = node
    return None


def _link_break(node: fx.Node, previous: fx.Node | None, inputs: tuple[fx.Node, ...]) -> str | None:
    """Why ``node`` is not the next unit applied to ``previous``'s output (or the inputs), or None."""
    if node.op != "call_module":
        return f"{_describe(node)} runs between units"
    if node.kwargs or not _takes(node, previous, inputs):
        after = "the model's inputs" if previous is None else f"the output of unit {previous.target!r}"
        return f"unit {node.target!r} takes {', '.join(a.name for a in node.all_input_nodes)}, not {after}"
    return None


def _order_break(called: list[str], names: list[str]) -> str:
    missing = [name for name in names if name not in called]
    if missing:
        return f"unit {missing[0]!r} is never called"
    repeated = [name for name in called if called.count(name) > 1]
    if repeated:
        return f"unit {repeated[0]!r} is called {called.count(repeated[0])} times"
    first = next(i for i, (a, b) in enumerate(zip(called, names)) if a != b)
    return f"forward calls {called[first]!r} where the registration order has {names[first]!r} (called: {called})"


def _is_item_of(node: fx.Node, unit: fx.Node | None) -> bool:
    """``unit_output[k]``: how a tuple output is passed on as positional arguments."""
    return (
        unit is not None
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[0] is unit
        and isinstance(node.args[1], int)
    )


def _takes(node: fx.Node, previous: fx.Node | None, inputs: tuple[fx.Node, ...]) -> bool:
    args: tuple[Any, ...] = node.args
    if previous is None:
        return len(args) > 0 and args == inputs[: len(args)]
    if args == (previous,):
        return True
    return len(args) > 0 and all(_is_item_of(arg, previous) and arg.args[1] == k for k, arg in enumerate(args))


def _returned(result: Any) -> str:
    return _describe(result) if isinstance(result, fx.Node) else repr(result)
