"""Device flags read on the host a fixed number of steps later, without a host-device synchronisation.

``.item()`` on a CUDA tensor waits for *every* kernel queued before it, so reading a per-step flag right away stalls
the pipeline that keeps the GPU busy. Here each flag is copied with ``non_blocking=True`` into pinned host memory
and a CUDA event is recorded after the copy. A flag is looked at once ``lag`` newer flags were pushed after it, by
then its copy has long landed (the event is only waited for if it has not, which bounds how far the host runs ahead
rather than stalling the device). A caller that checks before pushing, as ``AccelPrecision`` does at the start of each
step, learns of step ``t`` at step ``t + lag + 1``, at the same step on every rank and on every device type: under
DDP all ranks see the same (all-reduced) gradients, so they raise together instead of one rank leaving the others
waiting in the next collective. On CPU the copy is synchronous.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

__all__ = ["LaggedFlags"]


class LaggedFlags:
    """A queue of 0-d device booleans, each with a tag, read on the host once their copy has landed.

    Args:
        lag: a flag is read once this many newer flags were pushed after it.

    Example::

        flags = LaggedFlags(lag=1)
        flags.push(found_inf, tag=(step, batch_idx))  # no sync
        tag = flags.first_set()  # the tag of the oldest set flag among those with `lag` newer ones behind them
    """

    def __init__(self, lag: int = 1) -> None:
        if lag < 0:
            raise ValueError(f"LaggedFlags(lag={lag}): expected an int >= 0.")
        self.lag = lag
        self._pending: deque[tuple[Tensor, torch.cuda.Event | None, Any]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, flag: Tensor, tag: Any) -> None:
        """Queue ``flag`` (any shape; set when any element is non-zero) with ``tag``, without a host sync."""
        if flag.device.type == "cuda":
            host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            host.copy_(flag.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flag.detach().clone(), None  # a copy: the scaler updates its flag tensors in place
        self._pending.append((host, event, tag))

    def first_set(self, wait: bool = False) -> Any | None:
        """The tag of the oldest set flag among the due ones, dropping the clear ones; ``None`` if none.

        A flag is due once ``lag`` newer flags were pushed after it; newer flags are not looked at even when their copy
        has landed, so the answer does not depend on device timing.

        Args:
            wait: every queued flag is due (waits for their copies; for the end of training).
        """
        while self._pending and (wait or len(self._pending) > self.lag):
            host, event, tag = self._pending.popleft()
            if event is not None and not event.query():
                event.synchronize()  # `lag` steps old: in practice complete; bounds the host's run-ahead otherwise
            if bool(host.numpy().any()):  # host memory: reading it waits for nothing
                return tag
        return None

    def clear(self) -> None:
        """Forget every queued flag."""
        self._pending.clear()
