"""The verdict on the ranks' published states (``judge``) and the report the ranks concerned print.

Split from ``progress_watchdog`` (the thread that publishes and judges): what is decided and said, not how it is
watched. Rules: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["HangReport", "RankState", "format_report", "judge", "rank_ranges", "write_stderr"]


@dataclass(frozen=True)
class RankState:
    """What one rank publishes every interval: its progress and, once its main thread sits still, where it is."""

    rank: int
    seq: int  # marks plus the source's count: ranks running the same program agree; the smallest is furthest behind
    phase: str
    step: int | None
    stall_s: float  # seconds without progress
    allowance_s: float
    pid: int = 0
    host: str = ""
    kind: str = "running"  # or collective (waits for peers: never blamed), data, debugger, gone (:func:`locate`)
    call: str | None = None  # what it runs: ``torch.distributed.all_reduce``, ``torch.utils.data...``
    site: str | None = None  # its call into torch: the innermost frame outside torch and the standard library
    user: str | None = None  # the innermost frame of the user's own code
    stack: str | None = None
    status: Literal["running", "finished"] = "running"

    @property
    def overdue(self) -> bool:
        """Whether the rank has gone longer than its allowance without progress."""
        return self.stall_s > self.allowance_s


@dataclass(frozen=True)
class HangReport:
    """A verdict, the ranks it blames and the last state of every rank (ordered by rank)."""

    verdict: Literal["stuck", "divergent", "waiting"]
    culprits: tuple[int, ...]
    states: tuple[RankState, ...]

    @property
    def key(self) -> tuple:
        """The stall it describes (the blamed ranks' progress, or all): reported once, however long it lasts."""
        return tuple((s.rank, s.seq, s.status) for s in self.states if s.rank in self.culprits or not self.culprits)


def judge(states: dict[int, RankState], quiet_s: float) -> HangReport | None:
    """The verdict, from states in rank order; ``quiet_s``: seconds since any rank's progress or place changed."""
    live = [s for s in states.values() if s.status == "running"]
    if not live or any(s.kind == "debugger" for s in live):
        return None
    running = [s for s in live if s.kind != "collective"]
    if stuck := [s for s in running if s.overdue]:  # several: the furthest behind (a device hang stalls the others)
        return _report(states, "stuck", [s.rank for s in stuck if s.seq == min(t.seq for t in stuck)])
    if running:
        return None  # a rank within its allowance: the others legitimately wait for it
    return _waiting(states, live, quiet_s)


def _waiting(states: dict[int, RankState], live: list[RankState], quiet_s: float) -> HangReport | None:
    """Every live rank waits in a collective: divergent (in different places) or waiting, once quiet long enough."""
    places: dict[tuple, list[int]] = {}
    for s in states.values():
        places.setdefault((s.kind, s.phase, s.call, s.site) if s.status == "running" else (), []).append(s.rank)
    # Ranks waiting in different places can never meet: the shortest allowance applies. One collective everybody
    # waits in may legitimately be long (a large gather while checkpointing): the longest applies.
    allowances = [s.allowance_s for s in live]
    if quiet_s <= (min(allowances) if len(places) > 1 else max(allowances)):
        return None
    smallest = min(len(ranks) for ranks in places.values())
    blamed = [r for ranks in places.values() if len(ranks) == smallest for r in ranks] if len(places) > 1 else []
    return _report(states, "divergent" if blamed else "waiting", () if len(blamed) == len(states) else blamed)


def _report(states: dict[int, RankState], verdict: Any, blamed: Any) -> HangReport:
    """The verdict with the stacks of the blamed ranks only: every rank reads it."""
    kept = tuple(s if s.rank in blamed else replace(s, stack=None) for s in states.values())
    return HangReport(verdict, tuple(sorted(blamed)), kept)


def rank_ranges(ranks: Any) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda ir: ir[1] - ir[0])]
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _doing(s: RankState, culprits: tuple[int, ...]) -> str:
    waits = f" for rank {rank_ranges(culprits)}" if culprits and s.rank not in culprits else ""
    site = f", called from {s.site}" if s.site else ""
    return {
        "collective": f"waiting{waits} in {s.call}{site}",
        "data": f"waiting for the data pipeline in {s.call}" + (f", at {s.user}" if s.user else ""),
        "running": f"running your code at {s.user}" if s.user else f"running {s.call}{site}",
    }.get(s.kind, s.kind)


_ADVICE = {
    "data": "the data pipeline: a deadlocked or dead DataLoader worker, a hung filesystem, or fewer batches here",
    "code": "your code at {user}: if its work is legitimate (evaluation, an upload on one rank), raise the allowance"
    " of phase '{phase}'; else what blocks it there: a lock, I/O, a rank-dependent branch, or a GPU sync (.item())",
    "library": "{call}: compilation, I/O or a GPU sync that does not return; if legitimate, raise phase '{phase}''s",
    "divergent": "control flow that differs between ranks: a collective under a condition on the rank, the data or a"
    " metric, a collective on some ranks only, or ranks with different numbers of batches",
    "waiting": "every rank waits in one collective: the network, a process outside the job, or a device (NCCL_DEBUG)",
}


def format_report(report: HangReport, exit_code: int | None) -> str:
    """The report the ranks concerned print; ``exit_code`` None when the job goes on."""
    culprits, states = report.culprits, report.states
    s = next((t for t in states if t.rank in culprits), states[0])
    head, advice = _headline(report, s)
    lines = [f"HangWatchdog: {head}.", *_rank_lines(states, culprits)]
    for t in (t for t in states if t.rank in culprits and t.stack):
        lines += [f"Main-thread stack of rank {t.rank} (pid {t.pid} on {t.host}), most recent call last:", t.stack]
    lines.append("What to look at: " + _ADVICE[advice].format(user=s.user, phase=s.phase, call=s.call) + ".")
    end = f"Ending every rank with exit code {exit_code}: a blocked collective fails only at the group's timeout."
    lines.append(end if exit_code else "Report only: the job goes on.")
    return "\n".join(lines)


def _rank_lines(states: tuple[RankState, ...], culprits: tuple[int, ...]) -> list[str]:
    """A line per place: the ranks there, the longest stall and what they do (ranks in one place share it)."""
    groups: dict[tuple, list[RankState]] = {}
    for t in states:
        where = f"phase '{t.phase}' (step {t.step})" if t.status == "running" else ""
        groups.setdefault((where, _doing(t, culprits) if where else "finished"), []).append(t)
    lines = []
    for (where, doing), group in groups.items():
        stall = f"{where} for {max(t.stall_s for t in group):.0f} s: " if where else ""
        lines.append(f"  rank {rank_ranges(t.rank for t in group)}: {stall}{doing}")
    return lines


def _headline(report: HangReport, s: RankState) -> tuple[str, str]:
    """The report's first line and its advice's key, from the verdict and ``s`` (the first blamed rank, or rank 0)."""
    ranks = rank_ranges(report.culprits)
    if report.verdict == "stuck":
        head = f"rank {ranks} has made no progress for {s.stall_s:.1f} s in phase '{s.phase}' (step {s.step}, allowance"
        head += f" {s.allowance_s:g} s)" + ("; the other ranks wait for it" if len(report.states) > 1 else "")
        return head, "data" if s.kind == "data" else "code" if s.user else "library"
    if report.verdict == "divergent":
        who = f": rank {ranks} took another path" if report.culprits else ""
        return f"the ranks diverged, they wait in different places{who}", "divergent"
    return f"every rank has waited {s.stall_s:.1f} s in the same place", "waiting"


def write_stderr(text: str) -> None:
    """Write to file descriptor 2 (no Python lock a stuck thread may hold), a line at a time (ranks share a pipe)."""
    with contextlib.suppress(OSError):
        for line in text.splitlines(keepends=True):
            os.write(2, line.encode(errors="replace"))
