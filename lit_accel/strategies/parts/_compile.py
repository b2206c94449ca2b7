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
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lit_accel.layout.blocks import find_blocks
from lit_accel.utilities._compat import dynamo_graph_count

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
        self._steps_to_check = 0  # optimizer steps until the one check that the blocks compiled
        self._graphs_before = 0  # the graphs dynamo had made in this process when the blocks were compiled
        self._graphs_made = False  # whether an earlier fit's blocks made graphs (a later fit may find them cached)

    def apply(self, targets: list[nn.Module]) -> None:
        """Compile each target's ``forward`` in place (an instance attribute over the class's method)."""
        for module in targets:
            if "forward" in module.__dict__:
                continue  # compiled already (a further fit), or the user's own instance forward: left as it is
            module.forward = torch.compile(module.forward, **self.options)  # type: ignore[method-assign]
            self.modules.append(module)
        self._steps_to_check = 2 if self.modules else 0
        self._graphs_before = dynamo_graph_count()

    def after_step(self) -> None:
        """After each optimizer step, until the second: then say once which blocks ran eagerly (no compiled code)."""
        if not self._steps_to_check:
            return
        self._steps_to_check -= 1
        if self._steps_to_check:
            return
        # no graph since apply(): every frame was skipped (a later fit of the same blocks finds its graphs cached)
        self._graphs_made = self._graphs_made or dynamo_graph_count() > self._graphs_before
        if not self._graphs_made:
            eager = sorted({type(m).__name__ for m in self.modules})
            rank_zero_warn(
                f"{self.owner}(compile=...): {', '.join(eager)} ran eagerly in the first 2 training steps:"
                " torch.compile made no graph of their forward (each frame was skipped: a graph break at its start,"
                " torch.compiler.disable, or a dispatch mode at its first call on torch < 2.14). Fix:"
                " TORCH_LOGS=graph_breaks shows why; or compile=False."
            )

    def revert(self) -> None:
        """Back to the eager ``forward`` of every compiled module."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []
