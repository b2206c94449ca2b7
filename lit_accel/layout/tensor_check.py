"""The tensor plan checked against the unsharded model on the first real batch, before the first optimizer step.

A plan that pairs the wrong layers, or one whose pair has something between them that is not elementwise (a softmax
over the hidden width, a reshape that mixes it), still runs once parallelised, and would train a different model. So at
its first training forward, each module whose children the plan parallelised (an MLP, an attention) runs once more on
the same input with those children replaced by full copies (gathered one module at a time: never a second copy of the
model) and its changed attributes (a divided head count) restored; the two outputs must agree within the precision's
rounding. The verdicts of every rank are gathered before the first optimizer step, so every rank refuses together,
naming the module and the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PlanCheck"]

# Relative difference (of the whole output's norm) allowed: a sharded sum rounds in another order than the full one;
# a wrong plan differs by a large share of the output (a missing reduction: ~1/sqrt(2) at tensor_parallel=2).
_ALLOWED = {torch.float64: 1e-9, torch.float32: 1e-4}
_ALLOWED_LOW = 3e-2  # bf16, fp16 and anything narrower


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _full_copy(owner: str, name: str, child: nn.Module) -> nn.Module:
    """A plain module with ``child``'s full weights, without its parallel hooks.

    Linear and Embedding: what torch's column- and row-wise styles parallelise; anything else cannot be checked.
    """
    weight = _full(child.weight).detach()
    if isinstance(child, nn.Linear):  # (FSDP makes a sharded unit an ``FSDPLinear``)
        bias = child.bias
        copy = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        copy.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            copy.bias = nn.Parameter(_full(bias).detach(), requires_grad=False)
        return copy
    if isinstance(child, nn.Embedding):
        return nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=child.padding_idx)
    raise ValueError(
        f"{owner}(tensor_plan=...): entry {name!r} ({type(child).__name__}) cannot be checked against the unsharded"
        " model (only nn.Linear and nn.Embedding can), and an unverified plan never trains. Fix: parallelise its"
        " Linear layers with 'colwise'/'rowwise', or leave it out of tensor_plan."
    )


class PlanCheck:
    """Hooks on the parents of the parallelised modules, armed for the first training forward, and the verdict.

    Args:
        owner: the strategy's name, for messages.
        model: the model as built on this rank (its other stages pruned).
        tensor_modules: the names parallelised on this rank.
        changed: parent name -> {attribute: value before the plan} (what ``apply_plan`` changed).
        group: the tensor dimension's process group (``None``: the default group).
    """

    def __init__(
        self, owner: str, model: nn.Module, tensor_modules: list[str], changed: Mapping[str, dict], group: Any = None
    ) -> None:  # fmt: skip
        self.owner, self.changed, self.group = owner, dict(changed), group
        children: dict[str, list[str]] = {}
        for name in tensor_modules:
            parent, _, child = name.rpartition(".")
            children.setdefault(parent, []).append(child)
        self.model, self.children = model, children
        self.mismatches: list[str] = []  #: this rank's, one line each
        self.checked: set[str] = set()
        self.not_finite: set[str] = set()  # parents whose forwards so far gave infinities or NaNs
        self._handles: list[RemovableHandle] = []
        self._comparing, self.done = False, False

    @property
    def armed(self) -> bool:
        """Whether the hooks wait for the first training forward."""
        return bool(self._handles)

    def eager(self, compiling: bool) -> AbstractContextManager[Any]:
        """While armed, compiled blocks run eagerly: a graph would trace the hooks (their collectives, the swaps)."""
        return torch.compiler.set_stance("force_eager") if compiling and self.armed else nullcontext()

    def verdict_after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the first step's forward and backward), then :meth:`verdict` before the optimizer updates."""
        if self.done:
            return closure

        def run() -> Any:
            result = closure()
            self.verdict()
            return result

        return run

    def arm(self) -> None:
        """Hook every parent for its next forward (the first training one: after the sanity check); once per model."""
        if self.done or self._handles:  # a later fit of the same model: checked already
            return
        for parent in sorted(self.children):
            hook = functools.partial(self._compare, parent)
            # before FSDP's post-forward hook, which frees the gathered parameters
            module = self.model.get_submodule(parent)
            self._handles.append(module.register_forward_hook(hook, prepend=True, with_kwargs=True))

    def _compare(self, parent: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # the first forward only (a micro-batch, a pipeline's first chunk), and none inside a comparison (a nested
        # parent runs within its own parent's runs)
        if parent in self.checked or self._comparing:
            return
        # A tensor group's ranks take the same input; torch's pipeline stages first run on unset buffers (shape
        # inference), which differ: that forward compares nothing
        if not _same_on_every_rank([*args, *kwargs.values()], self.group):
            return
        # Both run again in eval mode: a dropout's mask differs between a shard and the whole, and no random state
        # moves. The sharded run makes the plan's collectives, in step on every rank of the tensor group.
        modes = [(m, m.training) for m in module.modules()]
        self._comparing = True
        module.eval()
        try:
            with torch.no_grad():
                got = _full(_first(module.forward(*args, **kwargs)))
                expected = _first(self._unsharded(parent, module, args, kwargs))
                finite = bool(got.isfinite().all() and expected.isfinite().all())
                difference = _relative_difference(got, expected)
        finally:
            self._comparing = False
            for m, training in modes:
                m.training = training
        if not finite:  # torch's pipeline stages infer shapes on unset inputs; fp16 can overflow: the next forward
            self.not_finite.add(parent)
            return
        self.checked.add(parent)
        allowed = _ALLOWED.get(expected.dtype, _ALLOWED_LOW)
        if not difference <= allowed:
            self.mismatches.append(
                f"{_named(parent)} gives another output sharded than whole on the first batch (relative difference"
                f" {difference:.2g}, {allowed:.0e} allowed in {str(expected.dtype).removeprefix('torch.')})"
            )

    def _unsharded(self, parent: str, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module``'s own forward with full copies of its parallelised children and its attributes restored."""
        names = self.children[parent]
        sharded = {name: getattr(module, name) for name in names}
        changed = self.changed.get(parent, {})
        now = {attribute: getattr(module, attribute) for attribute in changed}
        prefix = f"{parent}." if parent else ""
        copies = {name: _full_copy(self.owner, prefix + name, child) for name, child in sharded.items()}
        try:
            for name, copy in copies.items():
                setattr(module, name, copy)
            for attribute, before in changed.items():
                setattr(module, attribute, before)
            return module.forward(*args, **kwargs)
        finally:
            for name, child in sharded.items():
                setattr(module, name, child)
            for attribute, value in now.items():
                setattr(module, attribute, value)

    def verdict(self) -> None:
        """Once, before the first optimizer step, on every rank: the hooks removed, every rank's mismatches gathered.

        Raises:
            ValueError: on every rank, where any rank's parallelised module differs from its unsharded self.
        """
        for handle in self._handles:
            handle.remove()
        self._handles, self.done = [], True
        unchecked = sorted(set(self.children) - self.checked)
        lines = self.mismatches + [
            f"{_named(parent)} {'gave only non-finite values' if parent in self.not_finite else 'did not run'} in the"
            " first training step, so its part of the plan could not be checked"
            for parent in unchecked
        ]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, lines)
            lines = sorted({line for rank_lines in gathered for line in rank_lines})
        if lines:
            raise ValueError(
                f"{self.owner}(tensor_plan=...): the tensor plan would train a different model: {'; '.join(lines)}."
                " Fix: pair each 'colwise' Linear with the 'rowwise' one that takes its output, with nothing between"
                " them but elementwise operations (an activation, dropout), and each parallelised module running in"
                " every step; pass the plan explicitly (tensor_plan={...}), or train without tensor_parallel."
            )


def _same_on_every_rank(values: list[Any], group: Any) -> bool:
    """Whether the tensors among ``values`` hold the same numbers on every rank of ``group`` (one all-reduce)."""
    tensors = [_full(v).detach().float() for v in values if isinstance(v, Tensor)]
    if not tensors or not (dist.is_available() and dist.is_initialized()):
        return True
    sums = torch.stack([torch.stack([t.sum(), t.abs().sum()]) for t in tensors]).flatten().nan_to_num(0.0, 1e30, -1e30)
    spread = torch.cat([sums, -sums])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(spread[: len(sums)], -spread[len(sums) :]))


def _named(parent: str) -> str:
    return f"module {parent!r}" if parent else "the model"


def _first(output: Any) -> Any:
    """The output compared: a tensor, or the first item of a tuple (an attention's output and weights)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _relative_difference(got: Tensor, expected: Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    expected = expected.float()
    return float((got.float() - expected).norm() / expected.norm().clamp_min(1e-12))
