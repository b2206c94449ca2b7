"""Features of the installed torch that tests build on and that lit_accel's floor release lacks (CI runs both)."""

from __future__ import annotations

import inspect

from torch import nn

#: torch >= 2.12: ``nn.BatchNorm*d(bias=False)``; older releases have a weight without a bias only by hand.
BATCHNORM_TAKES_BIAS = "bias" in inspect.signature(nn.modules.batchnorm._BatchNorm.__init__).parameters
#: A keyword argument of ``DistributedDataParallel`` that only passes through (``forward_sync_buffers``, torch >= 2.13,
#: else ``broadcast_buffers``).
DDP_PASS_THROUGH = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


def batchnorm(cls: type[nn.Module], num_features: int, *, bias: bool = True, **kwargs: object) -> nn.Module:
    """``cls(num_features, bias=bias, **kwargs)`` on any torch: without the argument, the bias is removed by hand."""
    if BATCHNORM_TAKES_BIAS:
        return cls(num_features, bias=bias, **kwargs)
    layer = cls(num_features, **kwargs)
    if not bias:
        layer.register_parameter("bias", None)
    return layer
