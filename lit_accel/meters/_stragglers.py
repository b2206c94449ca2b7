"""Which rank holds the others up, by how much and in what: from the numbers every rank gathers at a logging step.

DDP's all-reduce makes every rank's window equally long, so a slow rank shows in what the *others* wait for. A rank's
own time is its window minus its waits on peers: minus its exposed gradient communication where the strategy measures
it (:class:`lit_accel.protocols.ExposedComm`), else minus the whole backward (which holds the wait; its compute is then
not seen). It splits into compute (forward, plus the backward without the wait), data loading (the data wait) and
host (the rest: optimizer step, callbacks, Python). The straggler is the rank whose own time exceeds the median of the
others' by the largest fraction; it is named when that fraction passes the threshold, and the part that exceeds the
others' the most is the cause. Formulas: ``docs/monitors.md``.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from lit_accel.utilities._units import format_percent, format_seconds

if TYPE_CHECKING:
    from lit_accel.meters._efficiency_metrics import RankWindow

__all__ = [
    "RankTime",
    "StragglerVerdict",
    "StragglerWatch",
    "gather_hostnames",
    "rank_time",
    "straggler_metrics",
    "verdict_of",
]

Cause = Literal["compute", "data loading", "host"]
# Weight of the newest window in the running average of own times: one window 60% slower moves it by 20%.
_NEWEST = 1 / 3
_FIXES = {
    "compute": "check that rank's device (clocks, throttling, another process on it) and its share of the work",
    "data loading": "give that rank's DataLoader more workers, or its host faster storage",
    "host": "look for Python work only that rank does (logging, callbacks, checkpoint I/O) or CPU contention on it",
}


@dataclass(frozen=True)
class RankTime:
    """One rank's own time in a window (not waiting on peers) and its parts, in seconds."""

    own_s: float
    compute_s: float
    data_s: float
    host_s: float

    def part(self, cause: Cause) -> float:
        return {"compute": self.compute_s, "data loading": self.data_s, "host": self.host_s}[cause]


def rank_time(row: RankWindow, has_exposed: bool) -> RankTime:
    """A rank's own time: forward + backward compute, data wait and host time (module docstring)."""
    backward_compute = max(0.0, row.backward_s - row.comm_exposed_s) if has_exposed else 0.0
    compute = row.forward_s + backward_compute
    if has_exposed and row.backwards == 0:  # no backward timed: the waits (e.g. FSDP's all-gathers) sit in the forward
        compute = max(0.0, row.forward_s - row.comm_exposed_s)
    host = max(0.0, row.window_s - row.data_wait_s - row.forward_s - row.backward_s) if row.backwards else 0.0
    return RankTime(compute + row.data_wait_s + host, compute, row.data_wait_s, host)


@dataclass(frozen=True)
class StragglerVerdict:
    """The slowest rank of a window; ``rank`` is -1 unless it stands out by more than the threshold."""

    rank: int
    slowest: int
    excess_frac: float
    excess_s: float
    cause: Cause

    def metrics(self) -> dict[str, float]:
        return {"straggler_rank": float(self.rank), "straggler_excess_frac": self.excess_frac}


def straggler_metrics(rows: list[RankWindow], has_exposed: bool, threshold: float) -> StragglerVerdict:
    """The verdict over every rank's row (at least two)."""
    return verdict_of([rank_time(r, has_exposed) for r in rows], threshold)


def verdict_of(times: list[RankTime], threshold: float) -> StragglerVerdict:
    """The slowest of the ranks' own times, by how much, in what; named when above ``threshold``."""
    excess = []
    for rank, mine in enumerate(times):
        others = statistics.median(t.own_s for i, t in enumerate(times) if i != rank)
        excess.append(mine.own_s / others - 1.0 if others > 0 else 0.0)
    slowest = max(range(len(times)), key=excess.__getitem__)
    others = [t for i, t in enumerate(times) if i != slowest]

    def lead(cause: Cause) -> float:
        return times[slowest].part(cause) - statistics.median(t.part(cause) for t in others)

    cause: Cause = max(("compute", "data loading", "host"), key=lead)
    extra = times[slowest].own_s - statistics.median(t.own_s for t in others)
    named = slowest if excess[slowest] > threshold else -1
    return StragglerVerdict(named, slowest, excess[slowest], extra, cause)


class StragglerWatch:
    """Names a window's straggler only if the running average agrees, and warns once per rank after a streak.

    A window's verdict names a rank only when the per-step own times averaged over the windows so far (starting from
    equal ranks, the newest window weighing 1/3) put the same rank above the threshold too: a scheduling hiccup that
    slows one rank for one window names nobody, a rank far slower is named from its first window on, one slightly
    slower (threshold to 3x threshold) after a few. Every rank sees the same gathered numbers,
    so every rank reaches the same verdicts and asks for the host names (a collective) at the same window.

    Args:
        windows: consecutive windows naming the same rank before the warning.
        warn: where the warning goes.
        hostnames: returns every rank's host name (called once, when a warning is due).
    """

    def __init__(self, windows: int, warn: Callable[[str], Any], hostnames: Callable[[], list[str]]) -> None:
        self.windows = windows
        self._warn = warn
        self._hostnames = hostnames
        self._hosts: list[str] | None = None
        self._average: list[RankTime] | None = None  # per step
        self._streak: tuple[int, int] = (-1, 0)  # (rank, consecutive windows naming it)
        self._warned: set[int] = set()
        #: Every window that named a straggler: step, rank, host (once known), excess, cause.
        self.records: list[dict[str, Any]] = []

    def reset(self) -> None:
        """Forget the running average, the streak and the records (a new fit)."""
        self._average, self._streak, self.records = None, (-1, 0), []

    def observe(self, rows: list[RankWindow], has_exposed: bool, threshold: float, step: int) -> StragglerVerdict:
        """One window's verdict (the rank named only if the running average agrees); warns when a streak is long."""
        verdict = straggler_metrics(rows, has_exposed, threshold)
        steps = max(rows[0].steps, 1.0)
        per_step = [_scaled(rank_time(r, has_exposed), 1.0 / steps) for r in rows]
        if self._average is None:  # the prior: equal ranks, so that one window alone must be far out to name one
            typical = RankTime(*(statistics.median(values) for values in zip(*map(astuple, per_step))))
            self._average = [typical] * len(per_step)
        average = self._average = [_mix(a, b) for a, b in zip(self._average, per_step)]
        if verdict_of(average, threshold).rank != verdict.rank:
            verdict = replace(verdict, rank=-1)
        rank, streak = self._streak
        self._streak = (verdict.rank, streak + 1 if verdict.rank == rank else 1)
        if verdict.rank >= 0:
            self._record(verdict, step, verdict.excess_s / steps)
        return verdict

    def _record(self, verdict: StragglerVerdict, step: int, per_step: float) -> None:
        self.records.append(
            {"step": step, "rank": verdict.rank, "excess_frac": verdict.excess_frac,
             "excess_s_per_step": per_step, "cause": verdict.cause}
        )  # fmt: skip
        if self._streak[1] < self.windows or verdict.rank in self._warned:
            return
        self._warned.add(verdict.rank)
        if self._hosts is None:
            self._hosts = self._hostnames()
        host = self._hosts[verdict.rank]
        self.records[-1]["host"] = host
        self._warn(
            f"EfficiencyMeter: rank {verdict.rank} on host {host} is the straggler: for {self._streak[1]} logging"
            f" windows its own time per step was {format_percent(verdict.excess_frac)} above the other ranks' median"
            f" ({format_seconds(per_step)} more per step), mostly {verdict.cause}. Fix: {_FIXES[verdict.cause]}."
        )


def _scaled(t: RankTime, factor: float) -> RankTime:
    return RankTime(t.own_s * factor, t.compute_s * factor, t.data_s * factor, t.host_s * factor)


def _mix(old: RankTime, new: RankTime) -> RankTime:
    return RankTime(*(a + _NEWEST * (b - a) for a, b in zip(astuple(old), astuple(new))))


def gather_hostnames(world_size: int) -> list[str]:
    """Every rank's host name: one ``all_gather_object`` (every rank must call it), or this host's without peers."""
    hosts: list[Any] = [socket.gethostname()] * world_size
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_gather_object(hosts, socket.gethostname())
    return [str(h) for h in hosts]
