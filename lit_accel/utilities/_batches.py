"""A training batch's samples: how many there are (dim 0 of its tensors) and a slice of them, whatever its nesting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_length", "split_batch"]


def batch_length(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its tensors, which must agree."""
    sizes = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            sizes.add(value.shape[0] if value.dim() else None)
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(batch)
    if len(sizes) != 1 or None in sizes:
        shown = sorted("0-dim" if size is None else str(size) for size in sizes)
        raise ValueError(
            f"a batch of tensors with dim-0 sizes {shown} cannot be split into micro-batches. Fix: give every tensor"
            " of the batch its samples along dim 0 (a scalar or a sequence-first tensor cannot be split)."
        )
    return sizes.pop()


def split_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of every tensor of ``batch`` (tensors, tuples, lists, dicts); other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: split_batch(v, start, stop) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(split_batch(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(split_batch(v, start, stop) for v in batch)
    return batch
