"""The search behind ``micro_batch_size="auto"``: the largest micro-batch that has run, one int agreed by every rank.

It runs on the first loaded batch of a fit, before the first optimizer step. Every trial runs the whole loaded batch
as the training will (each micro-batch's forward and backward) while the memory the training holds later and the
trial does not (the optimizer state the first step allocates, and what ``reserve_bytes`` adds) is allocated for real;
a size is kept only when its trial ran on every rank with its measured peak inside ``MARGIN`` of what was free. A
prediction may choose what to try next, never what to keep:

- ``by_attempts`` (no collective inside the trials: AccelDDP's forward, or AccelFSDP with every parameter gathered):
  an out-of-memory error in an attempt is caught, and when every rank's attempt is over one all-reduce agrees on its
  outcome. The whole loaded batch goes first; when it fails, the sizes grow from two samples until one fails, so that
  at most two attempts fail (a failed allocation can leave address space behind).
- ``by_measurement`` (collectives inside, nothing caught): trials grow from the smallest size; the next runs only when
  the last peak, the part that does not grow apart and the rest scaled by the ratio of the sizes, fits in ``MARGIN``
  of what is free now on every rank (smaller stepping stones where the next candidate is out of reach; one that fits
  can be kept).

Candidates halve from the loaded batch (``n, ceil(n/2), ..., 1``). :class:`SearchLog` keeps each trial's measured peak
and the free memory it ran in, for the report line. Details and the guarantees: ``docs/strategies.md``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from lit_accel.utilities._memory import PeakMemory, available_bytes

__all__ = [
    "SearchLog", "Trial", "any_rank", "by_attempts", "by_gathered_attempts", "by_measurement", "candidates", "confirm",
    "is_out_of_memory", "room_for",
]  # fmt: skip

#: A kept size's peak may use this share of the free memory: room for fragmentation and later allocations.
MARGIN = 0.9
#: A stepping stone (a size tried only to climb to the next candidate) grows the last trial by at least this factor.
STEP = 1.25
_LARGEST = 2**31
_UNKNOWN = 2**62  # free memory a rank cannot know: larger than any other, so the least known one wins


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


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f} MB"


@dataclass(frozen=True)
class Trial:
    """One size's trial, agreed over the ranks: the largest peak, the least free memory, whether any rank failed."""

    size: int
    peak_bytes: int | None  # None where the peak cannot be measured (or the trial ran out of memory)
    free_bytes: int | None
    out_of_memory: bool = False

    @property
    def fits(self) -> bool:
        """Ran on every rank, with the peak inside ``MARGIN`` of the free memory where both are known."""
        if self.out_of_memory:
            return False
        return self.peak_bytes is None or self.free_bytes is None or self.peak_bytes <= MARGIN * self.free_bytes

    def describe(self) -> str:
        if self.out_of_memory:
            return f"{self.size}: out of memory"
        if self.peak_bytes is None:
            return f"{self.size}: ran"
        free = "" if self.free_bytes is None else f" of {_mb(self.free_bytes)} free"
        return f"{self.size}: peak {_mb(self.peak_bytes)}{free}{'' if self.fits else ' (over the margin)'}"


@dataclass
class SearchLog:
    """The trials of one search, in the order they ran, and the size kept."""

    trials: list[Trial] = field(default_factory=list)
    chosen: int | None = None
    not_tried: tuple[int, float] | None = None  # the next size and the peak it might reach, when it was not run

    def largest_fitting(self, below: int | None = None) -> int | None:
        """The largest size (under ``below``) whose trial fitted so far: what a failing trial's message names."""
        sizes = [trial.size for trial in self.trials if trial.fits and (below is None or trial.size < below)]
        return max(sizes) if sizes else None

    def describe(self) -> str:
        """``tried 2: peak 19.4 MB of 54.0 MB free, ...; kept 8, 22.1 MB left``: what ran, what each held."""
        text = "tried " + ", ".join(trial.describe() for trial in self.trials)
        if self.not_tried is not None:
            size, bound = self.not_tried
            text += f"; {size} not tried (may need {_mb(bound)})"
        kept = [t for t in self.trials if t.size == self.chosen and t.fits]
        if kept and kept[-1].peak_bytes is not None and kept[-1].free_bytes is not None:
            text += f"; kept {self.chosen}, {_mb(kept[-1].free_bytes - kept[-1].peak_bytes)} left"
        return text


def _no_sample_fits(owner: str, trial: Trial | None = None) -> RuntimeError:
    size, held = (1, "") if trial is None else (trial.size, f" ({trial.describe()})")
    return RuntimeError(
        f"{owner}(micro_batch_size='auto'): a micro-batch of {size} sample(s) does not fit in memory{held}. Fix: a"
        " smaller model or input, activation checkpointing or sharding (AccelFSDP), or more memory."
    )


@contextlib.contextmanager
def _held(nbytes: int, device: torch.device) -> Iterator[None]:
    """``nbytes`` the training holds later and a trial does not, allocated (and touched) for the trial's length."""
    block = torch.zeros(nbytes, dtype=torch.uint8, device=device) if nbytes else None
    try:
        yield
    finally:
        del block


def _agree(size: int, failed: bool, peak: int | None, free: int | None, device: torch.device) -> Trial:
    """One all-reduce: any rank's failure, the largest peak and the least free memory, over the ranks that know them."""
    values = [int(failed), -1 if peak is None else peak, -_UNKNOWN if free is None else -free]
    failed_any, peak_max, free_neg = _all_reduce(torch.tensor(values, device=device), dist.ReduceOp.MAX).tolist()
    known_peak = peak_max >= 0 and not failed_any
    return Trial(size, int(peak_max) if known_peak else None, None if free_neg == -_UNKNOWN else -int(free_neg),
                 bool(failed_any))  # fmt: skip


def by_attempts(
    attempt: Callable[[int], None], cleanup: Callable[[], None], loaded: int, device: torch.device, owner: str,
    log: SearchLog, local_ranks: int = 1, reserve_bytes: int = 0,
) -> int:  # fmt: skip
    """The largest candidate whose attempt (every micro-batch's forward and backward, no collective) fits everywhere.

    ``attempt(size)`` runs the loaded batch as micro-batches of ``size``; ``cleanup()`` drops what it left (gradients,
    statistics) after each one. ``reserve_bytes`` stay allocated during the attempt. An attempt fails when it runs out
    of memory or, where its peak can be measured, when the peak passes ``MARGIN`` of the memory free at its start.
    """
    peak = PeakMemory(device)

    def tried(size: int) -> Trial:
        return _attempted(attempt, cleanup, size, device, log, local_ranks, peak, reserve_bytes)

    ascending = candidates(loaded)[::-1]
    if tried(loaded).fits:
        log.chosen = loaded
        return loaded
    for size in ascending[min(1, len(ascending) - 1) : -1]:  # from two samples (one only when two fail)
        if not tried(size).fits:
            break
        log.chosen = size
    if log.chosen is None and loaded > 1 and tried(1).fits:
        log.chosen = 1
    if log.chosen is None:
        _without_margin(log, owner)
    return log.chosen


def _without_margin(log: SearchLog, owner: str) -> NoReturn:
    """No size fitted with the margin: stop before the first step (a size kept without it could die later)."""
    ran = [trial for trial in log.trials if not trial.out_of_memory and trial.peak_bytes is not None]
    smallest = min(ran, key=lambda trial: trial.size) if ran else None
    if smallest is None:
        raise _no_sample_fits(owner, log.trials[-1] if log.trials else None)
    raise RuntimeError(
        f"{owner}(micro_batch_size='auto'): no micro-batch fits with a {1 - MARGIN:.0%} margin ({log.describe()})."
        f" Fix: micro_batch_size={smallest.size} to train without the margin (it ran), or a smaller model or input,"
        " activation checkpointing, sharding (AccelFSDP) or more memory."
    )


def _attempted(
    attempt: Callable[[int], None], cleanup: Callable[[], None], size: int, device: torch.device, log: SearchLog,
    local_ranks: int, peak: PeakMemory, reserve_bytes: int,
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
    trial = _agree(size, failed, peak.bytes if measurable else None, free, device)
    log.trials.append(trial)
    return trial


def by_gathered_attempts(
    attempt: Callable[[int], None], run: Callable[[int], None], cleanup: Callable[[], None],
    gathered: AbstractContextManager[Callable[[], None]], loaded: int, device: torch.device, owner: str,
    log: SearchLog, local_ranks: int = 1, reserve_bytes: int = 0, fixed_bytes: int = 0,
) -> int:  # fmt: skip
    """``by_attempts`` inside ``gathered``, then the size kept run once more by ``run``, collectives included.

    ``gathered`` is a block whose forwards and backwards make no collective; it gives a ``reset`` to call after each
    attempt (on every rank, in step).
    """
    run(min(loaded, 2))  # a first pass with the collectives pays the one-time costs (FSDP's lazy init)
    cleanup()
    with gathered as reset:
        # after each attempt, on every rank: its leftovers dropped, then the strategy recovered and gathered again
        size = by_attempts(attempt, lambda: (cleanup(), reset()), loaded, device, owner, log, local_ranks,
                           reserve_bytes + fixed_bytes)  # fmt: skip
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
        _without_margin(log, owner)
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
    """The last peak split: the part that stays (``fixed``, at most the peak) and the part that scales with size."""
    assert last.peak_bytes is not None
    kept = min(fixed, last.peak_bytes)
    return kept, last.peak_bytes - kept


def _bound(last: Trial, fixed: int, size: int) -> float:
    """The peak a trial of ``size`` may reach, from ``last``: the kept part, the rest scaled by the ratio of sizes."""
    kept, scaled = _parts(last, fixed)
    return kept + scaled * size / last.size


def _reachable(last: Trial, fixed: int, device: torch.device, local_ranks: int) -> int:
    """The largest size whose ``_bound`` fits in ``MARGIN`` of what is free now on every rank (an all-reduce)."""
    gc.collect()
    free = available_bytes(device, local_ranks)
    if last.peak_bytes is None or free is None:
        reach = 0
    else:
        kept, scaled = _parts(last, fixed)
        room = MARGIN * free - kept
        reach = _LARGEST if scaled <= 0 and room >= 0 else max(int(last.size * room / max(scaled, 1)), 0)
    return int(_all_reduce(torch.tensor([reach], device=device), dist.ReduceOp.MIN).item())
