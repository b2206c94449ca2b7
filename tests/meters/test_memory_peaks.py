"""The allocator's peaks restart with each fit: a second fit in the same process reports its own peak, not an older one.

``MemoryMonitor`` builds a new ``MemoryMeter`` at every fit start. The meter reads peaks from an ``AllocatorStats``
(on CUDA, ``torch.cuda``'s process-wide peaks); the allocator here keeps the same books as CUDA's caching allocator
(a peak since the last reset, cumulative retry and OOM counts), so the per-fit arithmetic runs without a GPU.
"""

from __future__ import annotations

import torch

from lit_accel.meters._allocator import CudaAllocatorStats
from lit_accel.meters.memory import MemoryMeter


class _Books:
    """An allocator's books as CUDA keeps them: held bytes, the peak since the last reset, cumulative counters."""

    def __init__(self) -> None:
        self.held = self.peak = 0.0
        self.retries = self.ooms = 0.0

    def allocate(self, nbytes: float) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def free(self, nbytes: float) -> None:
        self.held -= nbytes

    def peaks(self) -> tuple[float, float]:
        return self.peak, self.peak

    def counters(self) -> tuple[float, float]:
        return self.retries, self.ooms

    def reset_peaks(self) -> None:
        self.peak = self.held


def _fit(books: _Books, nbytes: float, ooms: int = 0) -> dict[str, float]:
    meter = MemoryMeter("cpu", allocator=books)  # what MemoryMonitor.on_train_start does at each fit
    books.allocate(nbytes)
    books.ooms += ooms
    books.free(nbytes)
    return meter.compute()


def test_each_fit_reports_its_own_peak_and_counters():
    books = _Books()
    books.allocate(5e6)  # held across fits (a model kept on the device)
    first = _fit(books, 100e6, ooms=2)
    second = _fit(books, 10e6)
    assert first["peak_allocated_mb"] == 105.0 and first["ooms"] == 2
    assert second["peak_allocated_mb"] == 15.0  # not 105: the first fit's peak is forgotten
    assert second["peak_reserved_mb"] == 15.0 and second["ooms"] == 0 and second["alloc_retries"] == 0


def test_reset_restarts_the_peak_too():
    books = _Books()
    meter = MemoryMeter("cpu", allocator=books)
    books.allocate(50e6)
    books.free(50e6)
    meter.reset()
    books.allocate(1e6)
    assert meter.compute()["peak_allocated_mb"] == 1.0


def test_no_allocator_on_cpu_and_the_cuda_one_on_a_cuda_device():
    assert "peak_allocated_mb" not in MemoryMeter("cpu").compute()
    assert MemoryMeter("cpu").allocator is None
    # The CUDA calls CudaAllocatorStats makes (run on a GPU by benchmarks/gpu_check.py's memory check).
    assert CudaAllocatorStats(torch.device("cuda", 0)).device == torch.device("cuda", 0)
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_stats", "reset_peak_memory_stats"):
        assert callable(getattr(torch.cuda, name)), name
