"""From every rank's published state to a verdict: which rank is stuck, or how the ranks diverged, and what to check.

The rule (docs/reliability.md (When a rank hangs) has the reasoning):

1. A rank that is *running* (not waiting in a collective or in autograd's backward) and has made no progress for
   longer than its phase's allowance is **stuck**; the ranks waiting for it are not blamed. Of several such ranks,
   those furthest behind (fewest phase changes) are blamed.
2. A running rank still within its allowance means the others legitimately wait for it: no verdict.
3. When every live rank waits, and even the most recent progress is older than the allowance (the smallest among
   them if they wait in different places, which can never complete; else the largest): a rank that stopped
   publishing is **silent** (frozen process); ranks waiting in different collectives, phases or call sites (or some
   finished while others wait) **diverged**; all waiting in the same place is reported as **waiting** (the culprit
   is outside this job's view: network, a device hang).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

__all__ = ["WAITING_KINDS", "HangReport", "RankState", "diagnose", "format_report", "rank_ranges"]

Verdict = Literal["stuck", "divergent", "waiting", "silent"]
WAITING_KINDS = ("collective", "backward")  # where a rank sits while a peer keeps it waiting

_HINTS = {
    "data": (
        "the data pipeline: a DataLoader worker that deadlocked (a lock or thread pool inherited through fork) or died"
        " silently, a dataset read from a hung filesystem, or a sampler that gives this rank fewer batches"
    ),
    "step": (
        "code in the training step that blocks (a lock, I/O, input()), a rank-dependent branch, or a GPU kernel that"
        " never returns (the host then waits in a synchronising call: .item(), .cpu(), torch.cuda.synchronize())"
    ),
    "validation": (
        "the validation data or metrics; raise validation_timeout if one validation batch legitimately takes longer"
    ),
    "checkpoint": "the filesystem the checkpoint is written to; raise checkpoint_timeout for large checkpoints",
    "setup": "model set-up, compilation or the first batch; raise first_step_timeout if it legitimately takes longer",
    "divergent": (
        "control flow that differs between ranks: a collective under a condition on the rank, the data or a metric"
        " (`if loss > x: all_reduce(...)`), a callback that calls a collective on rank 0 only, or ranks with"
        " different numbers of batches"
    ),
    "waiting": (
        "every rank waits in the same collective: a process outside this job, the network, or a hang on the device"
        " (NCCL: run with NCCL_DEBUG=INFO)"
    ),
    "silent": (
        "its process stopped publishing: it is frozen (SIGSTOP, swapped out, uninterruptible I/O on a hung"
        " filesystem) or native code holds the GIL; inspect it with `py-spy dump --pid PID` on its host"
    ),
}
_PHASE_HINT = {"forward": "step", "backward": "step", "optimizer_step": "step", "sanity_check": "validation"}


@dataclass(frozen=True)
class RankState:
    """What one rank publishes every interval: its progress and, when it has not progressed, where it is."""

    rank: int
    pid: int
    host: str
    seq: int  # phase changes so far: ranks running the same program agree, so the smallest is furthest behind
    phase: str
    step: int | None
    stall_s: float  # seconds since the last phase change
    allowance_s: float
    since_wall: float  # time.time() at the last phase change
    kind: str = "running"  # a stack_inspection.Kind; "running" until the rank has stalled for one interval
    call: str | None = None
    site: str | None = None
    user: str | None = None
    stack: str | None = None
    beat: int = 0
    status: Literal["running", "stopped", "reported"] = "running"

    @property
    def overdue(self) -> bool:
        return self.stall_s > self.allowance_s

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> RankState:
        return cls(**json.loads(data))


@dataclass(frozen=True)
class HangReport:
    """A verdict, the ranks it blames, the last state of every rank (stacks kept for the culprits only)."""

    verdict: Verdict
    culprits: tuple[int, ...]
    states: tuple[RankState, ...]
    silent: tuple[int, ...] = ()
    world_size: int = 1

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "verdict": self.verdict,
                "culprits": self.culprits,
                "states": [asdict(s) for s in self.states],
                "silent": self.silent,
                "world_size": self.world_size,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> HangReport:
        raw = json.loads(data)
        states = tuple(RankState(**s) for s in raw["states"])
        return cls(raw["verdict"], tuple(raw["culprits"]), states, tuple(raw["silent"]), raw["world_size"])

    def state(self, rank: int) -> RankState | None:
        return next((s for s in self.states if s.rank == rank), None)


def _report(verdict: Verdict, culprits: Iterable[int], states: Sequence[RankState], silent: Sequence[int], n: int):
    blamed = set(culprits)
    kept = tuple(s if s.rank in blamed else replace(s, stack=None) for s in sorted(states, key=lambda s: s.rank))
    return HangReport(verdict, tuple(sorted(blamed)), kept, tuple(sorted(silent)), n)


def diagnose(
    states: dict[int, RankState], world_size: int, silent: Iterable[int] = (), quiet_s: float | None = None
) -> HangReport | None:
    """The verdict for the latest states.

    ``silent``: ranks that stopped publishing or never did. ``quiet_s``: seconds since any rank's state last changed
    (phase, status, where it waits), as the caller observed it; without it, the smallest stall stands in. A rank that
    just finished while another still waits for it is a change, not a divergence.
    """
    gone = set(silent) | (set(range(world_size)) - set(states))
    live = [s for r, s in states.items() if r not in gone and s.status == "running"]
    finished = [s for s in states.values() if s.status != "running"]
    if not live or any(s.kind == "debugger" for s in live):  # someone sits in pdb: not a hang
        return None
    stuck = [s for s in live if s.kind not in WAITING_KINDS and s.overdue]
    if stuck:  # several (a device hang makes the others block in a sync, not in a collective): the furthest behind
        behind = min(s.seq for s in stuck)
        culprits = [s.rank for s in stuck if s.seq == behind]
        return _report("stuck", culprits, list(states.values()), sorted(gone), world_size)
    if any(s.kind not in WAITING_KINDS for s in live):
        return None  # a running rank within its allowance: the others wait for it
    groups: dict[tuple, list[int]] = {}
    for s in live:
        groups.setdefault((s.kind, s.phase, s.call, s.site), []).append(s.rank)
    if finished:
        groups[("finished",)] = [s.rank for s in finished]
    # Ranks waiting in different collectives can never complete them: the shortest allowance applies. One collective
    # everybody waits in may legitimately be long (a large gather while checkpointing): the longest applies.
    allowances = [s.allowance_s for s in live]
    quiet = min(s.stall_s for s in live) if quiet_s is None else quiet_s
    if quiet <= (min(allowances) if len(groups) > 1 else max(allowances)):
        return None
    if gone:
        return _report("silent", gone, list(states.values()), sorted(gone), world_size)
    if len(groups) == 1:
        return _report("waiting", (), list(states.values()), (), world_size)
    smallest = min(len(ranks) for ranks in groups.values())
    blamed = [r for ranks in groups.values() if len(ranks) == smallest for r in ranks]
    if len(blamed) == len(states):  # every group equally small (2 ranks, 1 each): no majority to compare with
        blamed = []
    return _report("divergent", blamed, list(states.values()), (), world_size)


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _phase(s: RankState) -> str:
    return f"phase {s.phase!r}" + ("" if s.step is None else f" (step {s.step})")


def _doing(s: RankState) -> str:
    if s.kind == "collective":
        return f"waiting in {s.call}" + (f", called from {s.site}" if s.site else "")
    if s.kind == "backward":
        return "in autograd's backward (where DDP waits for the gradient all-reduce)" + (
            f", called from {s.site}" if s.site else ""
        )
    if s.kind == "running" and s.call:
        if s.call in (s.user, s.site):
            return f"running its own code at {s.call}"
        return f"in {s.call}" + (f", called from {s.site}" if s.site else "")
    return "making progress" if s.kind == "running" else s.kind


def _lines_by_group(report: HangReport) -> list[str]:
    groups: dict[tuple, list[RankState]] = {}
    for s in report.states:
        key = ("silent",) if s.rank in report.silent else (s.status, s.kind, s.phase, s.step, s.call, s.site, s.user)
        groups.setdefault(key, []).append(s)
    lines = []
    for key, members in sorted(groups.items(), key=lambda kv: kv[1][0].rank):
        first, ranks = members[0], rank_ranges(s.rank for s in members)
        label = f"rank {ranks}" if len(members) == 1 else f"ranks {ranks}"
        if key == ("silent",):
            lines.append(f"  {label}: stopped publishing; last seen in {_phase(first)}, {_doing(first)}")
        elif first.status != "running":
            lines.append(f"  {label}: finished (watchdog stopped)")
        else:
            stall = max(s.stall_s for s in members)
            lines.append(f"  {label}: {_phase(first)} for {stall:.1f} s: {_doing(first)}")
    missing = set(range(report.world_size)) - {s.rank for s in report.states}
    if missing:
        lines.append(f"  ranks {rank_ranges(missing)}: never published (their watchdog did not start)")
    return lines


def _utc(wall: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(wall))


def format_report(report: HangReport, exit_code: int | None) -> str:
    """The multi-line report every rank prints; ``exit_code`` None when the job is left running."""
    by_rank = {s.rank: s for s in report.states}
    blamed = [by_rank[r] for r in report.culprits if r in by_rank]
    if report.verdict == "stuck":
        s = blamed[0]
        others = "" if report.world_size == 1 else "; the other ranks wait for it"
        head = (
            f"rank {rank_ranges(report.culprits)} is stuck in {_phase(s)}: no progress for {s.stall_s:.1f} s"
            f" (allowance {s.allowance_s:g} s, since {_utc(s.since_wall)}), {_doing(s)}{others}."
        )
        hint = _HINTS.get(_PHASE_HINT.get(s.phase, s.phase), _HINTS["step"])
    elif report.verdict == "divergent":
        places = sorted({f"{_phase(s)} ({_doing(s)})" for s in report.states if s.status == "running"})
        who = f"rank {rank_ranges(report.culprits)} took a different path; " if report.culprits else ""
        head = f"the ranks diverged: {who}they wait in different places: " + " vs ".join(places) + "."
        hint = _HINTS["divergent"]
    elif report.verdict == "silent":
        head = f"rank {rank_ranges(report.silent)} stopped reporting while every other rank waits for it."
        hint = _HINTS["silent"]
    else:
        s = report.states[0]
        head = f"every rank has waited in the same place for {s.stall_s:.1f} s: {_phase(s)}, {_doing(s)}."
        hint = _HINTS["waiting"]
    lines = [f"HangWatchdog: {head}", *_lines_by_group(report)]
    for s in blamed:
        if s.stack:
            lines += [f"Main-thread stack of rank {s.rank} (pid {s.pid} on {s.host}), most recent call last:", s.stack]
    lines.append(f"What to look at: {hint}.")
    if exit_code is None:
        lines.append("HangWatchdog(on_hang='report'): the job keeps running (it will wait for the collective timeout).")
    else:
        lines.append(
            f"Ending every rank with exit code {exit_code} (the blocked collective would only fail at the process"
            " group's timeout); each blamed rank dumps all its threads to its own stderr."
        )
    return "\n".join(lines)
