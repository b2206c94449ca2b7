"""A training batch's samples: how many there are (dim 0 of its tensors) and a slice of them, whatever its nesting.

Nesting as Lightning's own batch transfer walks it (``apply_to_collection``: mappings, sequences, namedtuples, the
``init`` fields of dataclasses), so micro-batching splits any batch Lightning can move to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_dataclass_instance

__all__ = ["batch_length", "split_batch"]


def batch_length(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its tensors, which must agree."""
    sizes = {tensor.shape[0] if tensor.dim() else None for tensor in _tensors(batch)}
    if len(sizes) != 1 or None in sizes:
        shown = sorted("0-dim" if size is None else str(size) for size in sizes)
        raise ValueError(
            f"a batch of tensors with dim-0 sizes {shown} cannot be split into micro-batches. Fix: give every tensor"
            " of the batch its samples along dim 0 (a scalar or a sequence-first tensor cannot be split)."
        )
    return sizes.pop()  # type: ignore[return-value]


def split_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of every tensor of ``batch``, in the same structure; other leaves as they are."""
    return apply_to_collection(batch, torch.Tensor, lambda tensor: tensor[start:stop])


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors ``split_batch`` slices, found without rebuilding anything (the planner counts raw batches)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif is_dataclass_instance(value):
        items = [getattr(value, field.name) for field in dataclasses.fields(value) if field.init]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = value
    else:
        return []
    return [tensor for item in items for tensor in _tensors(item)]
