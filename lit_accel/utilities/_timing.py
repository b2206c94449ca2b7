"""Sync-free interval timing: host clock on CPU, CUDA events on GPU, resolved only when asked.

On a GPU the host runs ahead of the device, so a host clock read in a hook says when the work was *queued*, not
when it ran. CUDA events are recorded on the stream without blocking the host; their elapsed times can only be
read once the device has passed them, which the caller arranges at logging steps (one ``synchronize`` there), as
torchtitan does (``torchtitan/components/metrics.py``) instead of syncing every step (DeepSpeed measured a 20-25%
slowdown from per-step timer syncs, microsoft/DeepSpeed#5363).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["IntervalTimer", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU). Call it at logging steps only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


class IntervalTimer:
    """Sum of the durations of ``start()``/``stop()`` intervals, without a host-device sync per interval.

    On CUDA each interval is a pair of timing events recorded on the current stream (events are pooled and
    reused); on any other device the host clock is read. :meth:`pop_total_s` resolves the intervals recorded since
    the previous pop: on CUDA it reads the events' elapsed times, which needs the device to have finished them, so
    call it after :func:`synchronize`, at logging steps only.

    Args:
        device: the device whose work is timed.
        clock: the host clock, in seconds (``time.perf_counter`` by default; injectable for tests).
    """

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self._cuda = device.type == "cuda"
        self._clock = clock
        self._host_total = 0.0
        self._host_start: float | None = None
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending_start: torch.cuda.Event | None = None
        self._pool: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Open an interval (a second start without a stop restarts it)."""
        if self._cuda:
            if self._pending_start is not None:
                self._pool.append(self._pending_start)
            self._pending_start = self._event()
        else:
            self._host_start = self._clock()

    def stop(self) -> None:
        """Close the open interval; without one, do nothing."""
        if self._cuda:
            if self._pending_start is not None:
                self._pairs.append((self._pending_start, self._event()))
                self._pending_start = None
        elif self._host_start is not None:
            self._host_total += self._clock() - self._host_start
            self._host_start = None

    def pop_total_s(self) -> float:
        """Seconds spent in the closed intervals since the previous pop. On CUDA: synchronize first."""
        if not self._cuda:
            total, self._host_total = self._host_total, 0.0
            return total
        total_ms = 0.0
        for begin, end in self._pairs:
            total_ms += begin.elapsed_time(end)
            self._pool.extend((begin, end))
        self._pairs.clear()
        return total_ms / 1e3
