"""Synchronised statistics for a BatchNorm class with its own forward, which a ``SyncBatchNorm`` cannot replace.

timm's ``BatchNormAct2d`` (most timm CNNs) normalises with ``F.batch_norm`` and then applies its drop and activation;
a synchronised layer in its place would drop those and train another model. Such a layer keeps its class and
``forward``: while that forward runs, its training-mode ``F.batch_norm`` calls go to the group's statistics (the
function :class:`~lit_accel.plugins.sync_batchnorm.SyncBatchNorm` computes with), everything else runs as written. A
layer whose forward normalises some other way makes no such call: its first training forward says so, once, and it
keeps per-rank statistics.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lit_accel.plugins.sync_batchnorm import batch_norm_over_group
from lit_accel.utilities._warnings import rank_zero_warn

__all__ = ["RoutedForward", "is_routed"]


def _batch_norm_arguments(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[Any, ...]:
    """Whether ``F.batch_norm`` is called in training mode, and its arguments in ``batch_norm_over_group``'s order."""
    return training, (input, weight, bias, running_mean, running_var, eps, momentum)


class _GroupStatistics(TorchFunctionMode):
    """Runs each training-mode ``F.batch_norm`` call with the statistics of ``process_group``'s joint batch."""

    def __init__(self, process_group: Any | None) -> None:
        super().__init__()
        self.process_group = process_group
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            training, arguments = _batch_norm_arguments(*args, **kwargs)
            if training:
                self.calls += 1
                return batch_norm_over_group(*arguments, self.process_group)
        return func(*args, **kwargs)


class RoutedForward:
    """A layer's own ``forward``, with its training-mode ``F.batch_norm`` calls synchronised.

    Set as the layer's instance ``forward`` (the class is untouched): it runs what ``forward`` was (an instance
    ``forward`` the layer already had, e.g. a compiled one, or its class's), and :meth:`remove` puts that back. Each
    call is a collective, so the layer must make as many of them on every rank (timm's layers make one per forward;
    one whose count depends on the local batch would leave its peers waiting).
    """

    def __init__(self, layer: nn.Module, name: str, process_group: Any | None) -> None:
        self.layer, self.name = layer, name
        self._statistics = _GroupStatistics(process_group)
        self._previous = layer.__dict__.get("forward")  # an instance forward of the user's, kept and given back
        self._checked = False
        layer.forward = self  # type: ignore[method-assign]

    def _communicates(self) -> bool:
        # as SyncBatchNorm's forward: only training forwards in a group of several ranks (decided per call, so a
        # model saved routed and loaded into one process trains as BatchNorm)
        group = self._statistics.process_group
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer
        if not (layer.training and self._communicates()):
            return self._run(*args, **kwargs)
        with self._statistics:
            out = self._run(*args, **kwargs)
        if not self._checked:
            self._checked = True
            if not self._statistics.calls:
                rank_zero_warn(
                    f"AccelSyncBatchNorm: {self.name!r} ({type(layer).__name__}) normalises without F.batch_norm, so"
                    " it keeps per-rank statistics. Fix: synchronise it with its library's converter in"
                    " configure_model, or pass sync_batchnorm=False to keep every BatchNorm per-rank."
                )
        return out

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """What ``forward`` was: the user's instance forward, else the class's."""
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def remove(self) -> None:
        """Give the layer back the ``forward`` it had."""
        if self.layer.__dict__.get("forward") is self:
            del self.layer.forward
            if self._previous is not None:
                self.layer.forward = self._previous  # type: ignore[method-assign]


def is_routed(layer: nn.Module) -> bool:
    """Whether ``layer``'s own forward runs with synchronised ``F.batch_norm`` calls."""
    return isinstance(layer.__dict__.get("forward"), RoutedForward)
