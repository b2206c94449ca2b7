"""What a ``micro_batch_size="auto"`` search records, and the messages that stop a fit when no size fits.

Its candidates, each trial agreed over the ranks, and the log its report line is made of.

A trial fits when it ran on every rank with its measured peak inside ``MARGIN`` of the memory free at its start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

import torch

__all__ = [
    "MARGIN", "SearchLog", "SearchStopped", "Trial", "candidates", "is_out_of_memory", "no_sample_fits",
    "without_margin",
]  # fmt: skip

#: A kept size's peak may use this share of the free memory: room for fragmentation and later allocations.
MARGIN = 0.9


class SearchStopped(RuntimeError):
    """The search's own stop (no size fits): its message is the one the user sees, never re-read as a memory error."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, the CPU allocator's "can't allocate memory", or a ``MemoryError`` (bad_alloc)."""
    if isinstance(error, SearchStopped):
        return False
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


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
    whole: bool = True  # False for a probe: the first micro-batches only, to bound the next size
    # what the trial left held on this rank (not agreed): one-time allocations, a BLAS workspace the first matmul of
    # more than one row keeps (9 MB on a CPU), in its peak and never again in a later one
    left_bytes: int = 0

    @property
    def fits(self) -> bool:
        """Ran on every rank, with the peak inside ``MARGIN`` of the free memory where both are known."""
        if self.out_of_memory:
            return False
        return self.peak_bytes is None or self.free_bytes is None or self.peak_bytes <= MARGIN * self.free_bytes

    def describe(self) -> str:
        size = str(self.size) if self.whole else f"{self.size} (probe)"
        if self.out_of_memory:
            return f"{size}: out of memory"
        if self.peak_bytes is None:
            return f"{size}: ran"
        free = "" if self.free_bytes is None else f" of {_mb(self.free_bytes)} free"
        return f"{size}: peak {_mb(self.peak_bytes)}{free}{'' if self.fits else ' (over the margin)'}"


@dataclass
class SearchLog:
    """The trials of one search, in the order they ran, and the size kept."""

    trials: list[Trial] = field(default_factory=list)
    chosen: int | None = None
    not_tried: tuple[int, float] | None = None  # the next size and the peak it might reach, when it was not run

    def largest_fitting(self, below: int | None = None) -> int | None:
        """The largest size (under ``below``) whose trial fitted so far: what a failing trial's message names."""
        sizes = [t.size for t in self.trials if t.whole and t.fits and (below is None or t.size < below)]
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


def no_sample_fits(owner: str, trial: Trial | None = None) -> SearchStopped:
    size, held = (1, "") if trial is None else (trial.size, f" ({trial.describe()})")
    return SearchStopped(
        f"{owner}(micro_batch_size='auto'): a micro-batch of {size} sample(s) does not fit in memory{held}. Fix: a"
        " smaller model or input, activation checkpointing or sharding (AccelFSDP), or more memory."
    )


def without_margin(log: SearchLog, owner: str) -> NoReturn:
    """No size fitted with the margin: stop before the first step (a size kept without it could die later)."""
    ran = [trial for trial in log.trials if trial.whole and not trial.out_of_memory and trial.peak_bytes is not None]
    smallest = min(ran, key=lambda trial: trial.size) if ran else None
    if smallest is None:
        raise no_sample_fits(owner, log.trials[-1] if log.trials else None)
    fitted = max((trial.size for trial in ran if trial.fits), default=None)
    if fitted is not None:  # it fitted, then a failed attempt left memory held (``_run_again_after_a_failure``)
        raise SearchStopped(
            f"{owner}(micro_batch_size='auto'): a micro-batch of {fitted} fitted, then a larger attempt ran out of"
            f" memory and what it left held keeps {fitted} from fitting again ({log.describe()}). Fix:"
            f" micro_batch_size={fitted} (it fits in a fresh process), or more memory."
        )
    raise SearchStopped(
        f"{owner}(micro_batch_size='auto'): no micro-batch fits with a {1 - MARGIN:.0%} margin ({log.describe()})."
        f" Fix: micro_batch_size={smallest.size} to train without the margin (it ran), or a smaller model or input,"
        " activation checkpointing, sharding (AccelFSDP) or more memory."
    )
