"""Count the FLOPs of real training work with :class:`torch.utils.flop_counter.FlopCounterMode`.

``FlopCounterMode`` is a ``TorchDispatchMode``: while it is active, every matmul, convolution and attention kernel
that runs on this thread (and on the autograd engine's threads, which inherit the mode) adds its analytic FLOP count
(2 x multiply-accumulates) to a total. It counts the forward *and* the backward, and only the gradients autograd
actually computes: a first layer whose input needs no gradient costs no input-gradient matmul. Element-wise ops
(activations, losses, optimizer updates) count zero, as in the usual MFU convention (PaLM, Chowdhery et al. 2022,
appendix B: "model FLOPs" are the matmul FLOPs of forward and backward).

The monitor enters the mode in one hook and leaves it in a later one, so it counts the first real training
micro-batch: no extra forward/backward, no perturbed BatchNorm statistics or RNG state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FlopCounter", "measure_flops"]


class FlopCounter:
    """A :class:`FlopCounterMode` that can be started in one callback hook and stopped in another.

    Example::

        counter = FlopCounter()
        counter.start()
        loss = model(x).sum()
        loss.backward()
        flops = counter.stop()  # forward + backward matmul FLOPs
    """

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None

    @property
    def active(self) -> bool:
        """Whether the counter is running."""
        return self._mode is not None

    def start(self) -> None:
        """Start counting on this thread (and the autograd threads it drives)."""
        if self._mode is not None:
            raise RuntimeError("FlopCounter.start() called twice without stop().")
        # display=False: FlopCounterMode would otherwise print a per-module table on exit.
        mode = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def stop(self) -> int:
        """Stop counting and return the FLOPs counted since :meth:`start`."""
        if self._mode is None:
            raise RuntimeError("FlopCounter.stop() called without start().")
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops())


def measure_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmuls (forward and backward) that ``fn`` runs.

    Args:
        fn: a callable that runs the work to count, e.g. ``lambda: model(x).sum().backward()``.

    Returns:
        The total FLOP count (2 x multiply-accumulates).

    Example::

        mlp = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
        flops = measure_flops(lambda: mlp(torch.randn(1, 1024)).sum().backward())
        # forward 2*2*1024*4096 + weight grads 2*2*1024*4096 + one input grad 2*1024*4096
    """
    counter = FlopCounter()
    counter.start()
    try:
        fn()
    finally:
        flops = counter.stop()
    return flops
