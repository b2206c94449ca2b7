"""Pipeline stages: the model's units in forward order, split into stages, each rank keeping only its own.

A *unit* is a child of the LightningModule, with ``nn.Sequential``/``nn.ModuleList``/``nn.ModuleDict`` containers
expanded into their items (``embed``, ``blocks.0`` ... ``blocks.7``, ``head``). Under a pipeline dimension the model's
forward must be these units applied in that order (the contract torchtitan's models follow); ``docs/strategies.md``
shows how to fold anything else (a positional embedding, a reshape) into a unit. The units of other ranks' stages are
replaced by ``nn.Identity`` at their place, so every parameter keeps its name and a distributed checkpoint reshards
between layouts.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["StageModule", "check_pipeline_loss", "pipeline_units", "prune_to", "split_units"]

#: The containers whose items are units of their own.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def pipeline_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of ``module`` in registration order: ``(name, unit)``, containers expanded."""
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, CONTAINERS):
                visit(f"{path}.", child)
            else:
                units.append((path, child))

    visit("", module)
    return units


def loose_parameters(module: nn.Module) -> list[str]:
    """Names of parameters that belong to ``module`` or one of its containers themselves, not to a unit."""
    loose = [name for name, _ in module.named_parameters(recurse=False)]
    for name, child in module.named_modules():
        if child is not module and isinstance(child, CONTAINERS):
            loose += [f"{name}.{p}" for p, _ in child.named_parameters(recurse=False)]
    return loose


def _has_params(unit: nn.Module) -> bool:
    return any(True for _ in unit.parameters())


def _repeated(units: list[tuple[str, nn.Module]]) -> list[int]:
    """Indices of the units of the class that repeats most among units with parameters (empty if none repeats)."""
    counts = Counter(type(u) for _, u in units if _has_params(u))
    repeated = [cls for cls, n in counts.items() if n > 1]
    if not repeated:
        return []
    cls = max(repeated, key=lambda c: counts[c])
    return [i for i, (_, u) in enumerate(units) if type(u) is cls]


def split_units(owner: str, names: list[str], units: list[tuple[str, nn.Module]], num_stages: int,
                split: Literal["auto"] | Sequence[str]) -> list[int]:  # fmt: skip
    """Index of the first unit of each stage (``num_stages`` ascending indices, the first 0).

    ``split="auto"``: the repeated blocks spread as evenly as they go (earlier stages take the extra one), what comes
    before the first block on stage 0, after the last on the last stage. Otherwise the names of the units where stages
    1, 2, ... begin.

    Raises:
        ValueError: too few units or blocks for the stages, or split names that are not units in ascending order.
    """
    if split != "auto":
        return _named_split(owner, names, num_stages, list(split))
    blocks = _repeated(units) or [i for i, (_, u) in enumerate(units) if _has_params(u)]
    if len(blocks) < num_stages:
        raise ValueError(
            f"{owner}: the model has {len(blocks)} repeated block(s) to split into {num_stages} pipeline stages."
            f" Fix: pass stage_split=[names of the units where stages 1..{num_stages - 1} begin] (units: {names}),"
            " or use fewer stages."
        )
    per_stage, extra = divmod(len(blocks), num_stages)
    starts, taken = [0], 0
    for stage in range(num_stages - 1):
        taken += per_stage + (1 if stage < extra else 0)
        starts.append(blocks[taken])
    return starts


def _named_split(owner: str, names: list[str], num_stages: int, split: list[str]) -> list[int]:
    if len(split) != num_stages - 1:
        raise ValueError(
            f"{owner}(stage_split={split}) names {len(split)} stage start(s) for {num_stages} stages. Fix: name"
            f" {num_stages - 1} unit(s) where stages 1..{num_stages - 1} begin, or pass stage_split='auto'."
        )
    unknown = [name for name in split if name not in names]
    if unknown:
        raise ValueError(
            f"{owner}(stage_split={split}): {unknown[0]!r} is not a unit of the model. Fix: use unit names, which"
            f" are {names}."
        )
    starts = [0] + [names.index(name) for name in split]
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise ValueError(
            f"{owner}(stage_split={split}): stages must begin at distinct units in forward order after the first"
            f" unit ({names[0]!r}). Fix: list the names in the order of {names}."
        )
    return starts


def stage_ranges(starts: list[int], num_units: int) -> list[range]:
    """The unit indices of each stage."""
    ends = [*starts[1:], num_units]
    return [range(a, b) for a, b in zip(starts, ends)]


def prune_to(module: nn.Module, units: list[tuple[str, nn.Module]], keep: set[str]) -> None:
    """Replace every unit of ``module`` whose name is not in ``keep`` by ``nn.Identity`` (names stay in place)."""
    for name, _ in units:
        if name not in keep:
            parent_name, _, leaf = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, leaf, nn.Identity())


def check_pipeline_loss(owner: str, module: nn.Module, pipeline: int) -> None:
    """A pipeline needs the module's ``pipeline_loss``."""
    if pipeline > 1 and not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"{owner}(pipeline_parallel={pipeline}) needs {type(module).__name__}.pipeline_loss(output, target)"
            " returning the mean loss of a micro-batch (the last stage computes it; training_step is not used)."
            " Fix: define pipeline_loss."
        )


class StageModule(nn.Module):
    """One pipeline stage: its units applied in order (a tuple output is passed on as positional arguments).

    The units stay registered where they were in the LightningModule too; this module only runs them, and under
    a data dimension it is the stage's FSDP root.
    """

    def __init__(self, index: int, units: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.index = index
        self.units = nn.ModuleList([unit for _, unit in units])

    def forward(self, *args: Any) -> Any:
        """The units in order, each output passed on as the next one's arguments."""
        # What crosses to a neighbour stage is contiguous, both ways: torch sizes the receiving buffers by the
        # strides it saw (``empty_strided``) and a process group sends only contiguous tensors (a transposing
        # nn.MultiheadAttention, as in torchvision's ViT, would otherwise fail in isend/irecv).
        values: tuple[Any, ...] = tuple(_ContiguousGradient.apply(a) if _tensor_needing_grad(a) else a for a in args)
        out: Any = None
        for unit in self.units:
            out = unit(*values)
            values = out if isinstance(out, tuple) else (out,)
        if isinstance(out, tuple):
            return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def _tensor_needing_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands a contiguous gradient to what sends it to the previous stage."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
