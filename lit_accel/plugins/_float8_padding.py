"""``RowPadding``: the rows of a converted layer's input padded to a multiple of 16 when the FP8 GEMMs need it.

Why and how (only unaligned batches, emulated layers too, left to torchao with ``pad_inner_dim``): docs/precision.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ALIGNMENT", "RowPadding", "rows_to_pad"]

#: What ``torch._scaled_mm`` needs the inner dimension and the second operand's dimensions to be multiples of.
ALIGNMENT = 16


def rows_to_pad(rows: int) -> int:
    """Zero rows to append so that ``rows`` becomes a multiple of :data:`ALIGNMENT`."""
    return -rows % ALIGNMENT


class RowPadding:
    """Forward hooks on FP8 layers: unaligned input rows padded before the layer, the padding sliced off after it."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._leading: dict[int, tuple[int, ...]] = {}  # id(layer) -> the unpadded input's leading dimensions

    def install(self, layers: list[nn.Module]) -> None:
        """Pad the input rows of each layer where they are not aligned.

        The pre-hook runs after the user's, the forward hook before theirs: their hooks see the unpadded tensors.
        """
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._pad))
            self._handles.append(layer.register_forward_hook(self._unpad, prepend=True))

    def remove(self) -> None:
        """Remove every hook :meth:`install` added."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._leading = [], {}

    def _pad(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        pad = rows_to_pad(rows)
        if not pad:
            self._leading.pop(id(layer), None)  # left by a forward that raised before its forward hook
            return None
        self._leading[id(layer)] = tuple(x.shape[:-1])
        return (F.pad(x.reshape(rows, features), (0, 0, 0, pad)), *args[1:])

    def _unpad(self, layer: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        leading = self._leading.pop(id(layer), None)
        if leading is None:
            return None
        return output[: math.prod(leading)].reshape(*leading, output.shape[-1])
