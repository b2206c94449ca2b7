"""Tensor-parallel plans: module name -> style, given by the user or found (``"auto"``) for the common pairs.

``"auto"`` finds two patterns (Megatron-LM's split, Shoeybi et al., 2019, section 3): an MLP, a ``Linear`` registered
right after another (only parameter-free modules, such as an activation, between them) whose input width is the first
one's output width (the first column-wise, the second row-wise, so the pair
needs one all-reduce in forward and one in backward); and attention, ``Linear`` children named like query, key and
value projections (column-wise) with an output projection (row-wise), the module's head count divided by the tensor
size so that its reshapes see the local heads. Anything else stays replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TensorPlan", "apply_plan", "auto_plan", "check_plan", "head_attribute", "resolve_plan"]

TensorPlan = Literal["auto"] | Mapping[str, Any] | None
_STYLE_NAMES = ("colwise", "rowwise", "sequence")
_QKV = (("q", "k", "v"), ("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"), ("query", "key", "value"))
_OUT = ("o", "o_proj", "out_proj", "wo", "proj", "out", "dense")
_HEADS = ("num_heads", "n_heads", "n_head", "nheads", "num_attention_heads")


def _is_style(value: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return value in _STYLE_NAMES or isinstance(value, ParallelStyle)


def check_plan(owner: str, plan: object) -> None:
    """Check ``tensor_plan``'s shape at construction.

    Raises:
        TypeError: not ``"auto"``, ``None`` or a mapping of names to styles.
    """
    if plan is None or plan == "auto":
        return
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and _is_style(v) for k, v in plan.items()):
        raise TypeError(
            f"{owner}(tensor_plan={plan!r}): expected 'auto', None or a dict of module name -> 'colwise', 'rowwise',"
            " 'sequence' or a torch ParallelStyle. Fix: e.g. {'blocks.0.fc1': 'colwise', 'blocks.0.fc2': 'rowwise'}."
        )


def _style(value: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    named = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    return named[value]() if isinstance(value, str) else value


def _attention(module: nn.Module) -> tuple[list[str], str] | None:
    linears = {name for name, child in module.named_children() if isinstance(child, nn.Linear)}
    for qkv in _QKV:
        out = next((name for name in _OUT if name in linears), None)
        if set(qkv) <= linears and out is not None:
            return list(qkv), out
    return None


def _mlp_pairs(module: nn.Module, tensor: int) -> list[tuple[str, str]]:
    """Linear children registered one after the other with only parameter-free modules between (an activation)."""
    pairs: list[tuple[str, str]] = []
    previous: tuple[str, nn.Linear] | None = None
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if (
                previous is not None
                and previous[1].out_features == child.in_features
                and child.in_features % tensor == 0
            ):
                pairs.append((previous[0], name))
                previous = None
            else:
                previous = (name, child)
        elif any(True for _ in child.parameters()):
            previous = None
    return pairs


def auto_plan(owner: str, model: nn.Module, tensor: int) -> dict[str, str]:
    """The ``"auto"`` plan of ``model`` (module docstring); head counts are checked, not yet divided.

    Raises:
        ValueError: an attention module without a head count divisible by ``tensor``.
    """
    plan: dict[str, str] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        attention = _attention(module)
        if attention is not None:
            heads = next((h for h in _HEADS if isinstance(getattr(module, h, None), int)), None)
            if heads is None or getattr(module, heads) % tensor:
                found = "no head count" if heads is None else f"{heads}={getattr(module, heads)}"
                raise ValueError(
                    f"{owner}(tensor_plan='auto'): attention module {prefix!r} has {found}, not a multiple of"
                    f" tensor_parallel={tensor} (head counts: one of {_HEADS}). Fix: a tensor_parallel that divides"
                    " the heads, or an explicit tensor_plan."
                )
            plan.update({f"{dot}{name}": "colwise" for name in attention[0]})
            plan[f"{dot}{attention[1]}"] = "rowwise"
            continue
        for a, b in _mlp_pairs(module, tensor):
            plan.setdefault(f"{dot}{a}", "colwise")
            plan.setdefault(f"{dot}{b}", "rowwise")
    return plan


def resolve_plan(owner: str, model: nn.Module, plan: TensorPlan, tensor: int) -> dict[str, Any]:
    """The plan to apply to ``model`` (whole, before stages are split): names checked against its modules.

    Raises:
        ValueError: a name that is not a module of the model, or an empty ``"auto"`` plan.
    """
    if plan is None or tensor == 1:
        return {}
    resolved = auto_plan(owner, model, tensor) if plan == "auto" else dict(plan)
    names = {name for name, _ in model.named_modules()}
    unknown = sorted(set(resolved) - names)
    if unknown:
        raise ValueError(f"{owner}(tensor_plan=...): {unknown[0]!r} is not a module of the model. Fix: use its names.")
    if not resolved:
        raise ValueError(
            f"{owner}(tensor_parallel={tensor}, tensor_plan='auto') found no Linear pair or attention to split."
            " Fix: pass an explicit tensor_plan, or tensor_parallel=1."
        )
    if plan != "auto":  # (the "auto" plan pairs by construction)
        _check_pairs(owner, model, resolved)
    return resolved


def _check_pairs(owner: str, model: nn.Module, plan: dict[str, Any]) -> None:
    """Refuse a ``"colwise"``/``"rowwise"`` Linear without its partner in the same parent (Megatron's pairing).

    A row-wise Linear takes the sharded output of a column-wise one registered before it (its input width that
    one's output width); a column-wise one gives its sharded output to a row-wise one registered after it. Anything
    else would shard a layer whose neighbour expects the whole tensor. Styles given as torch objects are the user's.
    """
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and plan.get(n) in _STYLE_NAMES}
    for name, linear in linears.items():
        parent = name.rpartition(".")[0]
        siblings = [(n, m) for n, m in linears.items() if n.rpartition(".")[0] == parent]
        index = [n for n, _ in siblings].index(name)
        if plan[name] == "rowwise":
            width = linear.in_features
            partner = [n for n, m in siblings[:index] if plan[n] == "colwise" and m.out_features == width]
            missing = f"a 'colwise' Linear registered before it whose output width is its input width ({width})"
        elif plan[name] == "colwise":
            partner = [n for n, _ in siblings[index + 1 :] if plan[n] == "rowwise"]
            missing = "a 'rowwise' Linear registered after it in the same module, to take its sharded output"
        else:
            continue
        if not partner:
            raise ValueError(
                f"{owner}(tensor_plan=...): entry {name!r}: {plan[name]!r} has no partner: {missing}, so it would"
                " shard a layer whose neighbour expects the whole tensor. Fix: pair each 'colwise' Linear with the"
                " 'rowwise' one that takes its output (e.g. {'fc1': 'colwise', 'fc2': 'rowwise'}), or"
                " tensor_plan='auto'."
            )


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> tuple[list[str], dict[str, dict]]:
    """Parallelize the modules of ``plan`` that this rank holds; divide attention head counts.

    Returns:
        The names applied, and parent name -> {attribute: its value before} for each attribute changed.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    present = {name: module for name, module in model.named_modules()}
    local = {name: style for name, style in plan.items() if name in present and type(present[name]) is not nn.Identity}
    if local:
        parallelize_module(model, mesh, {name: _style(style) for name, style in local.items()})
    changed: dict[str, dict] = {}
    for name in sorted({n.rpartition(".")[0] for n in local}):
        parent = model.get_submodule(name)
        heads = head_attribute(parent)
        if heads is not None:
            before = getattr(parent, heads)
            setattr(parent, heads, before // mesh.size())
            changed[name] = {heads: before}
            # the user's object changes: said once, naming the attribute and both values
            rank_zero_info(
                f"tensor_parallel={mesh.size()}: {name or 'the model'}.{heads} changed from {before} to"
                f" {before // mesh.size()} on every rank (its reshapes see the local heads)."
            )
    return sorted(local), changed


def head_attribute(module: nn.Module) -> str | None:
    """The head-count attribute of an attention module ``"auto"`` splits (divided by the tensor size), or None."""
    if _attention(module) is None:
        return None
    return next((h for h in _HEADS if isinstance(getattr(module, h, None), int)), None)
