"""The device allocator's host-side counters that ``MemoryMeter`` reads: peaks since the last reset, retries, OOMs.

A small interface (``AllocatorStats``) so that the meter's per-fit arithmetic (peaks restart with each fit) does not
depend on a CUDA device being present; ``CudaAllocatorStats`` is the real one, over ``torch.cuda``'s public calls.
Reading them is host-side bookkeeping of the caching allocator: no device sync.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["AllocatorStats", "CudaAllocatorStats"]


class AllocatorStats(Protocol):
    """What ``MemoryMeter`` reads from a device allocator (bytes and counts as floats)."""

    def peaks(self) -> tuple[float, float]:
        """``(peak allocated, peak reserved)`` bytes since the last :meth:`reset_peaks` (or the process start)."""
        ...

    def counters(self) -> tuple[float, float]:
        """``(allocation retries, out-of-memory errors)`` since the process started."""
        ...

    def reset_peaks(self) -> None:
        """Restart both peaks from the memory held now."""
        ...


class CudaAllocatorStats:
    """``AllocatorStats`` of one CUDA device's caching allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peaks(self) -> tuple[float, float]:
        """Peak allocated and reserved bytes (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``)."""
        return float(torch.cuda.max_memory_allocated(self.device)), float(torch.cuda.max_memory_reserved(self.device))

    def counters(self) -> tuple[float, float]:
        """``num_alloc_retries`` and ``num_ooms`` of ``torch.cuda.memory_stats``."""
        stats = torch.cuda.memory_stats(self.device)
        return float(stats.get("num_alloc_retries", 0)), float(stats.get("num_ooms", 0))

    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: process-wide for the device, as every peak reader sees it."""
        torch.cuda.reset_peak_memory_stats(self.device)
