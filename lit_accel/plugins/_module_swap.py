"""Swapping a model's modules for others, and back: what the SyncBatchNorm and FP8 plugins do while fitting."""

from __future__ import annotations

from collections.abc import Callable

from torch.nn import Module

__all__ = ["swap_modules"]


def swap_modules(model: Module, swap: Callable[[Module], Module | None]) -> Module:
    """``model`` with ``swap(m)`` in place of each module ``m`` for which it is not None (the root too: returned).

    A module shared at several places is swapped once and stays shared; one registered under two names is reached
    under both (through ``_modules``: ``named_children()`` lists it once).
    """
    memo: dict[int, Module] = {}

    def visit(module: Module) -> Module:
        if id(module) not in memo:
            new = swap(module)
            memo[id(module)] = out = module if new is None else new
            for name, child in list(module._modules.items()):
                out._modules[name] = None if child is None else visit(child)
        return memo[id(module)]

    return visit(model)
