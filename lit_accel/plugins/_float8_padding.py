"""``RowPadding``: the rows of a converted layer's input padded to a multiple of 16 when the FP8 GEMMs need it.

``torch._scaled_mm`` (the FP8 tensor-core GEMM) needs its second operand's dimensions and the inner dimension to be
multiples of 16. ``Float8Conversion`` checks a Linear's in/out features; the rows of its input (batch x tokens, M)
are the inner dimension of the weight-gradient GEMM (``grad_out.T [N, M] @ x [M, K]``) and change with every batch:
a ViT's 197 tokens at a batch of 3 give 591 rows, and Lightning's last partial batch can be any size. torchao's
``pad_inner_dim`` pads the inner dimension of all three GEMMs with a copy, aligned or not; this pads only the rows,
only when they are not aligned (a shape test on the host, no sync). Zero rows add nothing to the weight gradient or
to the FP8 scales (an amax), and their outputs are sliced off, so the result is that of the unpadded rows.

Emulated layers are padded too, so that FP8 emulation on a CPU runs the shapes the tensor cores get.
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
    """Forward hooks on FP8 layers: unaligned input rows padded before the layer, the padding sliced off after it.

    Example::

        padding = RowPadding()
        padding.install([model.fc1, model.fc2])  # converted Float8Linear layers
        ...
        padding.remove()
    """

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
