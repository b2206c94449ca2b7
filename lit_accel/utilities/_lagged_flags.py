"""Device flags read on the host a step or two later, without a host-device synchronisation.

``.item()`` on a CUDA tensor waits for *every* kernel queued before it, so reading a per-step flag right away stalls
the pipeline that keeps the GPU busy. Here each flag is copied with ``non_blocking=True`` into pinned host memory
and a CUDA event is recorded after the copy; later steps look only at flags whose event has completed
(``Event.query()`` never blocks). The answer arrives late, never with a stall. On CPU the copy is synchronous and
every flag is ready at once.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

__all__ = ["LaggedFlags"]


class LaggedFlags:
    """A queue of 0-d device booleans, each with a tag, read on the host once their copy has landed.

    Example::

        flags = LaggedFlags()
        flags.push(found_inf, tag=(step, batch_idx))  # no sync
        tag = flags.first_set()  # the tag of the oldest flag that was set, among those already on the host
    """

    def __init__(self) -> None:
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
        """The tag of the oldest set flag among those on the host, dropping the clear ones; ``None`` if none.

        Args:
            wait: wait for every queued copy (a host sync; for the end of training).
        """
        while self._pending:
            host, event, tag = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return None
                event.synchronize()
            self._pending.popleft()
            if bool(host.numpy().any()):  # host memory: reading it waits for nothing
                return tag
        return None

    def clear(self) -> None:
        """Forget every queued flag."""
        self._pending.clear()
