"""The search behind ``micro_batch_size="auto"``: the largest micro-batch that fits, one int agreed by every rank.

It runs on the first loaded batch of a fit, before the first optimizer step, and never catches an out-of-memory error
inside a collective sequence, by construction:

- ``by_attempts`` (a forward without collectives, AccelDDP): each candidate runs every chunk's forward and backward
  with gradient sync off, so an attempt holds no collective; the ranks agree on its outcome with one all-reduce made
  when every rank's attempt is over, and halve together.
- ``by_measurement`` (collectives in forward or backward, AccelFSDP): the loaded batch runs as the training will, with
  the smallest candidate first, and its peak memory is measured; the next candidate runs only when that peak, scaled
  by the ratio of the sizes, fits what is free on every rank (one all-reduce between runs). Nothing is caught.

Candidates halve from the loaded batch (``n, ceil(n/2), ..., 1``). Both keep room for the optimizer state the first
step will allocate. Details and the guarantees: ``docs/strategies.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from lit_accel.utilities._memory import PeakMemory

__all__ = ["any_rank", "by_attempts", "by_measurement", "candidates", "is_out_of_memory"]

#: Predicted peaks may use this share of the free memory: fragmentation and buffers the probes did not see.
MARGIN = 0.9


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, the CPU allocator's "can't allocate memory", or a ``MemoryError`` (bad_alloc)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _all_reduce(value: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=op)
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one 1-element all-reduce and one host read."""
    return bool(_all_reduce(torch.tensor([int(flag)], device=device), dist.ReduceOp.MAX).item())


def candidates(loaded: int) -> list[int]:
    """The sizes tried, largest first: the loaded batch, halved (rounding up) down to 1."""
    sizes = [loaded]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    return sizes


def _no_sample_fits(owner: str) -> RuntimeError:
    return RuntimeError(
        f"{owner}(micro_batch_size='auto'): a single sample per micro-batch does not fit in memory. Fix: a smaller"
        " model or input, activation checkpointing or sharding (AccelFSDP), or more memory."
    )


def by_attempts(
    attempt: Callable[[int], None], cleanup: Callable[[], None], loaded: int, device: torch.device, owner: str,
    free_bytes: int | None = None, reserve_bytes: int = 0,
) -> int:  # fmt: skip
    """The largest candidate whose attempt (forward and backward of every chunk, no collective) fits on every rank.

    ``attempt(size)`` runs the loaded batch as chunks of ``size``; ``cleanup()`` drops what it left (gradients,
    statistics) after each one. An attempt fails when it runs out of memory or, where its peak can be measured, when
    the peak passes ``free_bytes`` less a margin and ``reserve_bytes`` (memory the training holds later, such as the
    optimizer state); where it cannot, ``reserve_bytes`` stay allocated during the attempt instead.
    """
    measurable = free_bytes is not None and PeakMemory.supported(device)
    budget = MARGIN * free_bytes - reserve_bytes if measurable else None  # type: ignore[operator]
    peak = PeakMemory(device)
    for size in candidates(loaded):
        failed = False
        try:
            reserve = None if measurable else torch.empty(reserve_bytes, dtype=torch.uint8, device=device)
            with peak.measure() if measurable else contextlib.nullcontext():
                attempt(size)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            failed = True
        reserve = None  # noqa: F841 - freed before the next attempt
        cleanup()  # after the except block: the failure's frames (and their activations) are gone
        failed = failed or (budget is not None and peak.bytes > budget)
        if not any_rank(failed, device):  # every rank's attempt is over: the only collective of the search
            return size
    raise _no_sample_fits(owner)


def by_measurement(
    run: Callable[[int], None], cleanup: Callable[[], None], loaded: int, device: torch.device, owner: str,
    free_bytes: int, reserve_bytes: int = 0, smallest: int = 1,
) -> int:  # fmt: skip
    """The largest candidate reached by growing from the smallest while the next one is bounded to fit, on all ranks.

    ``run(size)`` runs micro-batches of ``size`` as the training will, collectives included; its peak is measured.
    The peak is a maximum of phases that each take a fixed part plus a part per sample, so it grows at most in
    proportion to the micro-batch: the next size runs only when the last peak times the ratio of the sizes, or the
    last peak plus twice the last growth per sample, fits in ``free_bytes`` (with a margin, ``reserve_bytes`` kept
    back) on every rank; one all-reduce between two runs agrees on it. The first run takes two samples; when even
    its peak does not fit, ``smallest`` is chosen (1, or 2 for models with BatchNorm layers).
    """
    budget = MARGIN * free_bytes - reserve_bytes
    ascending = candidates(loaded)[::-1]
    first = ascending[min(1, len(ascending) - 1)]  # two samples where there are: the bound to three is then 1.5x
    peak = PeakMemory(device)
    _measured(peak, run, cleanup, first)  # a first pass pays the one-time costs (lazy init, first allocations)
    points = [(first, _measured(peak, run, cleanup, first))]
    if any_rank(points[0][1] > budget, device):
        return min(smallest, first)  # smaller needs less: no run needed to know it fits better
    ladder = [size for size in ascending if size > first]
    if ladder and ladder[0] > first + 1:
        ladder.insert(0, first + 1)  # one sample more: a second point for the growth per sample
    chosen = first
    for size in ladder:
        if any_rank(_bound(points, size) > budget, device):
            break
        points.append((size, _measured(peak, run, cleanup, size)))
        if size in ascending and not any_rank(points[-1][1] > budget, device):
            chosen = size
    return chosen


def _bound(points: list[tuple[int, int]], size: int) -> float:
    """The peak ``size`` may reach, from the measured (size, peak) points."""
    last_size, last_peak = points[-1]
    bound = last_peak * size / last_size
    if len(points) > 1:
        before_size, before_peak = points[-2]
        per_sample = max(last_peak - before_peak, 0) / (last_size - before_size)
        bound = min(bound, last_peak + 2 * per_sample * (size - last_size))
    return bound


def _measured(peak: PeakMemory, run: Callable[[int], None], cleanup: Callable[[], None], size: int) -> int:
    with peak.measure():
        run(size)
    cleanup()
    return peak.bytes
