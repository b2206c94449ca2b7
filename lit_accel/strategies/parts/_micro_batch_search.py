"""The search behind ``micro_batch_size="auto"``: the largest micro-batch that has run, one int agreed by every rank.

It runs on the first loaded batch of a fit, before the first optimizer step. Every trial runs the whole loaded batch
as the training will (each micro-batch's forward and backward) while the memory the training holds later and the
trial does not (the optimizer state the first step allocates, and what ``reserve_bytes`` adds) is allocated for real;
a size is kept only when its trial ran on every rank with its measured peak inside ``MARGIN`` of what was free. A
prediction may choose what to try next, never what to keep:

- ``by_attempts`` (no collective inside the trials: AccelDDP's forward, or AccelFSDP with every parameter gathered):
  an out-of-memory error in an attempt is caught, and when every rank's attempt is over one all-reduce agrees on its
  outcome. A probe (the smallest size, two micro-batches) measures the peak; each next attempt is the largest
  candidate whose bound from the last one fits, so the sizes climb and a tight cap is met without a failed attempt
  first (a failed allocation can leave address space behind). Unmeasured, the whole loaded batch goes first.
- ``by_measurement`` (collectives inside, nothing caught): trials grow from the smallest size; the next runs only when
  the last peak, the part that does not grow apart and the rest scaled by the ratio of the sizes, fits in ``MARGIN``
  of what is free now on every rank (smaller stepping stones where the next candidate is out of reach; one that fits
  can be kept).

Candidates halve from the loaded batch (``n, ceil(n/2), ..., 1``). :class:`SearchLog` keeps each trial's measured peak
and the free memory it ran in, for the report line. Details and the guarantees: ``docs/strategies.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from lit_accel.strategies.parts._micro_batch_trials import (
    MARGIN,
    SearchLog,
    Trial,
    candidates,
    is_out_of_memory,
    without_margin,
)
from lit_accel.utilities._memory import PeakMemory, available_bytes

__all__ = ["any_rank", "by_attempts", "by_gathered_attempts", "by_measurement", "confirm", "room_for"]

#: A stepping stone (a size tried only to climb to the next candidate) grows the last trial by at least this factor.
STEP = 1.25
_LARGEST = 2**31
_UNKNOWN = 2**62  # free memory a rank cannot know: larger than any other, so the least known one wins


def _all_reduce(value: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=op)
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one 1-element all-reduce and one host read."""
    return bool(_all_reduce(torch.tensor([int(flag)], device=device), dist.ReduceOp.MAX).item())


@contextlib.contextmanager
def _held(nbytes: int, device: torch.device) -> Iterator[None]:
    """``nbytes`` the training holds later and a trial does not, allocated (and touched) for the trial's length."""
    block = torch.zeros(nbytes, dtype=torch.uint8, device=device) if nbytes else None
    try:
        yield
    finally:
        del block


def _agree(
    size: int, failed: bool, peak: int | None, free: int | None, device: torch.device, whole: bool = True
) -> Trial:  # fmt: skip
    """One all-reduce: any rank's failure, the largest peak and the least free memory, over the ranks that know them."""
    values = [int(failed), -1 if peak is None else peak, -_UNKNOWN if free is None else -free]
    failed_any, peak_max, free_neg = _all_reduce(torch.tensor(values, device=device), dist.ReduceOp.MAX).tolist()
    known_peak = peak_max >= 0 and not failed_any
    return Trial(size, int(peak_max) if known_peak else None, None if free_neg == -_UNKNOWN else -int(free_neg),
                 bool(failed_any), whole)  # fmt: skip


def by_attempts(
    attempt: Callable[..., None], cleanup: Callable[[], None], loaded: int, device: torch.device, owner: str,
    log: SearchLog, local_ranks: int = 1, reserve_bytes: int = 0, fixed_bytes: int = 0, smallest: int = 1,
) -> int:  # fmt: skip
    """The largest candidate whose attempt (every micro-batch's forward and backward, no collective) fits everywhere.

    ``attempt(size, limit=None)`` runs the loaded batch as micro-batches of ``size`` (only the first ``limit`` of
    them when given); ``cleanup()`` drops what it left (gradients, statistics) after each one. ``reserve_bytes`` stay
    allocated during the attempt; ``fixed_bytes`` is the part of its peak that does not grow with the size (the
    accumulated gradients). An attempt fails when it runs out of memory or, where its peak can be measured, when the
    peak passes ``MARGIN`` of the memory free at its start.

    Where the peak is measured, a probe (the smallest size, two micro-batches) comes first and each next attempt is
    the largest candidate whose bound from the last one fits: the sizes climb from the smallest, so a tight cap keeps
    it without a failed attempt first (under ``RLIMIT_AS`` a failed allocation can leave address space behind). A
    failed attempt goes down to the next candidate, the smallest whole after two failures.
    """
    peak = PeakMemory(device)

    def tried(size: int, limit: int | None = None) -> Trial:
        run = attempt if limit is None else functools.partial(attempt, limit=limit)
        whole = limit is None or limit * size >= loaded
        return _attempted(run, cleanup, size, device, log, local_ranks, peak, reserve_bytes, whole)

    ascending = candidates(loaded)[::-1]
    start = next((size for size in ascending if size >= smallest), loaded)
    if available_bytes(device, local_ranks) is None or not PeakMemory.supported(device):
        return _unmeasured(tried, ascending, start, loaded, owner, log)
    # the first pass pays the one-time costs (first allocations, the autograd engine's), which the training pays in
    # this search too and never again: unmeasured, so that they do not inflate the probe's bound (4 MB of a 19 MB
    # peak at one sample on a CPU)
    if not _warmed_up(attempt, cleanup, start, device):
        log.trials.append(Trial(start, None, None, out_of_memory=True, whole=False))
        without_margin(log, owner)
    probe = tried(start, limit=2)
    if not probe.fits:
        without_margin(log, owner)
    if probe.whole:
        log.chosen = start
    _climb(tried, probe, ascending, start, reserve_bytes + fixed_bytes, device, local_ranks, log)
    if log.chosen is None:
        without_margin(log, owner)
    return log.chosen


def _climb(
    tried: Callable[..., Trial], probe: Trial, ascending: list[int], start: int, fixed: int, device: torch.device,
    local_ranks: int, log: SearchLog,
) -> None:  # fmt: skip
    """From the probe: up to the largest candidate in reach of the last peak, down after a failure (``log.chosen``)."""
    failed: list[int] = []  # the sizes whose attempt failed, never tried again
    target = _next_up(probe, ascending, fixed, device, local_ranks, log)
    while target is not None:
        trial = tried(target)
        if trial.fits:
            log.chosen = max(log.chosen or 0, target)
            below_failed = [size for size in ascending if not failed or size < min(failed)]
            target = _next_up(trial, below_failed, fixed, device, local_ranks, log)
            continue
        failed.append(target)
        target = _next_down(target, ascending, start, len(failed), log.chosen)
    if failed:
        _run_again_after_a_failure(tried, ascending, log)


def _run_again_after_a_failure(tried: Callable[..., Trial], ascending: list[int], log: SearchLog) -> None:
    """Keep only a size that ran after the last failed attempt.

    A failed attempt can leave memory held (address space under ``RLIMIT_AS``): the kept size runs again where a
    failure came after it, and the next smaller one where it then fails.
    """
    last = log.trials[-1]
    while log.chosen is not None and not (last.whole and last.size == log.chosen and last.fits):
        last = tried(log.chosen)
        if not last.fits:
            smaller = [size for size in ascending if size < log.chosen]
            log.chosen = smaller[-1] if smaller else None


def _warmed_up(attempt: Callable[..., None], cleanup: Callable[[], None], size: int, device: torch.device) -> bool:
    """The first two micro-batches of ``size`` run once, an out-of-memory error caught: whether all ranks ran them."""
    failed = False
    try:
        attempt(size, limit=2)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        failed = True
    cleanup()
    return not any_rank(failed, device)


def _next_up(
    last: Trial, ascending: list[int], fixed: int, device: torch.device, local_ranks: int, log: SearchLog
) -> int | None:  # fmt: skip
    """The largest of ``ascending`` above the last whole size whose bound fits (a probe's own size counts)."""
    floor = last.size if last.whole else last.size - 1
    above = [size for size in ascending if size > floor]
    if not above:
        return None
    reach = _reachable(last, fixed, device, local_ranks)
    fitting = [size for size in above if size <= reach]
    if fitting:
        return fitting[-1]
    if not last.whole:
        return above[0]  # the probe's size, whole, even where its bound is tight
    # the bound scales the peak past the fixed part, which overestimates where memory grows slower than the size
    # (allocator blocks, buffers the micro-batches share): the next size is tried while its bound is below what is
    # free, and kept only if its measured peak keeps the margin
    if above[0] <= _reachable(last, fixed, device, local_ranks, share=1.0):
        return above[0]
    log.not_tried = (above[0], _bound(last, fixed, above[0]))
    return None


def _next_down(failed: int, ascending: list[int], start: int, failures: int, chosen: int | None) -> int | None:
    """After a failed attempt: the next candidate below it (above the kept one); the smallest after two failures."""
    below = [size for size in ascending if (chosen or 0) < size < failed]
    if not below:
        return None
    if failures < 2:
        return below[-1]
    return start if chosen is None else None


def _unmeasured(
    tried: Callable[..., Trial], ascending: list[int], start: int, loaded: int, owner: str, log: SearchLog
) -> int:  # fmt: skip
    """Without a measured peak: the whole loaded batch first, then the sizes grow from the smallest until one fails."""
    if tried(loaded).fits:
        log.chosen = loaded
        return loaded
    for size in (size for size in ascending if start <= size < loaded):
        if not tried(size).fits:
            break
        log.chosen = size
    if log.chosen is None:
        without_margin(log, owner)
    return log.chosen


def _attempted(
    attempt: Callable[[int], None], cleanup: Callable[[], None], size: int, device: torch.device, log: SearchLog,
    local_ranks: int, peak: PeakMemory, reserve_bytes: int, whole: bool = True,
) -> Trial:  # fmt: skip
    """One attempt on every rank, an out-of-memory error caught, then the one all-reduce that agrees on it (logged)."""
    free = available_bytes(device, local_ranks)
    measurable = free is not None and PeakMemory.supported(device)
    failed = False
    try:
        with peak.measure() if measurable else contextlib.nullcontext(), _held(reserve_bytes, device):
            attempt(size)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        failed = True
    cleanup()  # after the except block: the failure's frames (and their activations) are gone
    trial = _agree(size, failed, peak.bytes if measurable else None, free, device, whole)
    gc.collect()
    after = available_bytes(device, local_ranks)
    trial = dataclasses.replace(trial, left_bytes=0 if free is None or after is None else max(free - after, 0))
    log.trials.append(trial)
    return trial


def by_gathered_attempts(
    attempt: Callable[[int], None], run: Callable[[int], None], cleanup: Callable[[], None],
    gathered: AbstractContextManager[Callable[[], None]], loaded: int, device: torch.device, owner: str,
    log: SearchLog, local_ranks: int = 1, reserve_bytes: int = 0, fixed_bytes: int = 0, smallest: int = 1,
) -> int:  # fmt: skip
    """``by_attempts`` inside ``gathered``, then the size kept run once more by ``run``, collectives included.

    ``gathered`` is a block whose forwards and backwards make no collective; it gives a ``reset`` to call after each
    attempt (on every rank, in step).
    """
    # a first pass with the collectives pays the one-time costs (FSDP's lazy init): the smallest size, two micro-batches
    run(next((size for size in candidates(loaded)[::-1] if size >= smallest), loaded), limit=2)
    cleanup()
    with gathered as reset:
        # after each attempt, on every rank: its leftovers dropped, then the strategy recovered and gathered again
        size = by_attempts(attempt, lambda: (cleanup(), reset()), loaded, device, owner, log, local_ranks,
                           reserve_bytes + fixed_bytes, fixed_bytes, smallest)  # fmt: skip
    confirm(run, cleanup, size, device, log, local_ranks, reserve_bytes)
    return size


def by_measurement(
    run: Callable[[int], None], cleanup: Callable[[], None], loaded: int, device: torch.device, owner: str,
    log: SearchLog, local_ranks: int = 1, reserve_bytes: int = 0, fixed_bytes: int = 0, smallest: int = 1,
) -> int:  # fmt: skip
    """The largest candidate that ran, collectives included, within the margin on every rank, growing from the smallest.

    ``run(size)`` runs the loaded batch as micro-batches of ``size`` as the training will, collectives included; its
    peak is measured with ``reserve_bytes`` held. The peak is a maximum of phases that each take a fixed part plus a
    part per sample; ``fixed_bytes`` is what a trial of several micro-batches holds whatever their size (the
    gradients they accumulate). Beyond the reserve and that, the peak grows at most in proportion to the micro-batch
    (short of kernels that change with the size): the next size runs only when this bound fits in ``MARGIN`` of the
    memory free now, on every rank. The first trial takes two samples (one when ``smallest`` is 1 and two do not fit;
    2 for models with BatchNorm layers).
    """
    ascending = candidates(loaded)[::-1]
    first = ascending[min(1, len(ascending) - 1)]  # two samples where there are
    fixed = reserve_bytes + fixed_bytes

    def trial(size: int) -> Trial:
        return confirm(run, cleanup, size, device, log, local_ranks, reserve_bytes)

    with _held(reserve_bytes, device):
        run(first)  # a first pass pays the one-time costs (lazy init, first allocations, communication buffers)
    cleanup()
    last = trial(first)
    if not last.fits and smallest < first and _reachable(last, fixed, device, local_ranks) >= 1:
        last = trial(1)
    if not last.fits:
        without_margin(log, owner)
    log.chosen = last.size
    for target in (s for s in ascending if s > last.size):
        while last.size < target:  # stepping stones where the bound does not reach the target at once
            step = min(target, _reachable(last, fixed, device, local_ranks))
            if step < target and step < max(last.size + 1, STEP * last.size):
                log.not_tried = (target, _bound(last, fixed, target))
                return log.chosen
            last = trial(step)
            if not last.fits:
                return log.chosen
            log.chosen = step  # it ran: kept (a short last micro-batch is weighted exactly)
        log.chosen = target
    return log.chosen


def confirm(
    run: Callable[[int], None], cleanup: Callable[[], None], size: int, device: torch.device, log: SearchLog,
    local_ranks: int = 1, reserve_bytes: int = 0,
) -> Trial:  # fmt: skip
    """Run ``size`` as the training will (``run``, collectives included) with ``reserve_bytes`` held; log its peak."""
    peak, free = PeakMemory(device), available_bytes(device, local_ranks)
    with peak.measure(), _held(reserve_bytes, device):
        run(size)
    cleanup()
    result = _agree(size, False, peak.bytes, free, device)
    log.trials.append(result)
    return result


def room_for(nbytes: int, device: torch.device, local_ranks: int = 1) -> bool:
    """Whether ``nbytes`` fit in ``MARGIN`` of what is free now on every rank (one all-reduce)."""
    free = available_bytes(device, local_ranks)
    return not any_rank(free is None or nbytes > MARGIN * free, device)


def _parts(last: Trial, fixed: int) -> tuple[int, int]:
    """Split the last peak into the part that stays and the part that scales with size.

    The staying part is ``fixed``, at most the peak; the scaling part leaves out what the trial left held, as that
    is no longer free and a later trial does not allocate it again.
    """
    assert last.peak_bytes is not None
    kept = min(fixed, last.peak_bytes)
    return kept, max(last.peak_bytes - kept - last.left_bytes, 0)


def _bound(last: Trial, fixed: int, size: int) -> float:
    """The peak a trial of ``size`` may reach, from ``last``: the kept part, the rest scaled by the ratio of sizes."""
    kept, scaled = _parts(last, fixed)
    return kept + scaled * size / last.size


def _reachable(last: Trial, fixed: int, device: torch.device, local_ranks: int, share: float = MARGIN) -> int:
    """The largest size whose ``_bound`` fits in ``share`` of what is free now on every rank (an all-reduce)."""
    gc.collect()
    free = available_bytes(device, local_ranks)
    if last.peak_bytes is None or free is None:
        reach = 0
    else:
        kept, scaled = _parts(last, fixed)
        room = share * free - kept
        reach = _LARGEST if scaled <= 0 and room >= 0 else max(int(last.size * room / max(scaled, 1)), 0)
    return int(_all_reduce(torch.tensor([reach], device=device), dist.ReduceOp.MIN).item())
