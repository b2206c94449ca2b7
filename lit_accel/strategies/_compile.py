"""``torch.compile`` inside the strategies: each block's ``forward`` compiled in place, before DDP or FSDP wrap it.

Compiling the blocks rather than the wrapper keeps what the wrappers hang on the modules outside the graphs: DDP's
gradient hooks fire as each block's compiled backward produces its gradients (buckets still overlap), FSDP2's
per-block all-gather and reshard hooks run around each compiled region (torchtitan's order: compile, then shard).
The module objects, their classes and ``state_dict`` keys do not change, and ``teardown`` puts the eager ``forward``
back. Lightning calls ``training_step`` directly, so compiling the LightningModule itself would miss a step that
calls ``self.net(x)``; its blocks are compiled instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lit_accel.strategies._fsdp_sharding import find_blocks

__all__ = ["ForwardCompilation", "check_compile", "compile_targets"]

_COMPILE_KEYS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def check_compile(owner: str, compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``compile``'s ``torch.compile`` keyword arguments (``None``: no compile); raise naming a bad value."""
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, Mapping):
        raise TypeError(
            f"{owner}(compile={compile!r}): expected a bool or torch.compile's keyword arguments. Fix: compile=True"
            " or compile={'mode': 'max-autotune'}."
        )
    unknown = sorted(set(compile) - set(_COMPILE_KEYS))
    if unknown:
        raise ValueError(
            f"{owner}(compile={dict(compile)!r}): {unknown[0]!r} is no torch.compile argument. Fix: use some of"
            f" {', '.join(_COMPILE_KEYS)}."
        )
    return dict(compile)


def compile_targets(owner: str, model: nn.Module, blocks: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules to compile: ``blocks`` (FSDP's units), else the repeated composite blocks, else the children.

    Repeated blocks are a transformer's; a model without them compiles its top-level children that hold parameters
    (compiling single layers would fuse nothing).
    """
    if blocks:
        return blocks
    repeated = [block for block in find_blocks(owner, model, "auto") if any(True for _ in block.children())]
    return repeated or [child for child in model.children() if any(True for _ in child.parameters())]


class ForwardCompilation:
    """The compiled ``forward`` of each target module, and how to undo it."""

    def __init__(self, owner: str, options: dict[str, Any]) -> None:
        self.owner, self.options = owner, options
        self.modules: list[nn.Module] = []

    def apply(self, targets: list[nn.Module]) -> None:
        """Compile each target's ``forward`` in place (an instance attribute over the class's method)."""
        for module in targets:
            if "forward" in module.__dict__:
                continue  # compiled already (a further fit), or the user's own instance forward: left as it is
            module.forward = torch.compile(module.forward, **self.options)  # type: ignore[method-assign]
            self.modules.append(module)

    def revert(self) -> None:
        """Back to the eager ``forward`` of every compiled module."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []
