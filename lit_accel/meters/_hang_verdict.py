"""The ranks' states, one verdict and one report; docs/reliability.md (When a rank hangs) has the rules.

The stack decides what a rank does (:func:`locate`), the phase is a hint. Source lines are never read: on a hung
filesystem ``linecache`` would block the very thread that must report it.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, Literal

import torch

__all__ = ["WAITING", "HangReport", "RankState", "format_report", "judge", "locate", "rank_ranges"]

WAITING = ("collective", "backward")  # where a rank sits while a peer keeps it waiting: never blamed


def _dir(path: str) -> str:
    return os.path.normcase(os.path.abspath(path)) + os.sep


_TORCH = _dir(os.path.dirname(torch.__file__))
_SITE = tuple({_dir(p) for key in ("purelib", "platlib") if (p := sysconfig.get_path(key))})
_STDLIB = tuple({_dir(p) for key in ("stdlib", "platstdlib") if (p := sysconfig.get_path(key))})
_LIBRARY = ("<", *_SITE, *_STDLIB, _TORCH, _dir(os.path.dirname(os.path.dirname(__file__))))  # and lit_accel
_COLLECTIVE = (_TORCH + os.path.join("distributed", ""), _TORCH + os.path.join("nn", "parallel", "distributed.py"))
_DATA, _AUTOGRAD = _TORCH + os.path.join("utils", "data", ""), _TORCH + os.path.join("autograd", "")


def _file(frame: FrameType) -> str:
    name = frame.f_code.co_filename
    return name if name.startswith("<") else os.path.normcase(os.path.abspath(name))


def _where(frame: FrameType, torch_api: bool = False) -> str:
    """``path:line in function``, the path relative to its root; a torch frame as its API: ``torch.distributed.x``."""
    name, function = _file(frame), getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    if torch_api and name.startswith(_TORCH) and name.endswith(".py"):
        module = os.path.relpath(name[:-3], os.path.dirname(_TORCH[:-1])).replace(os.sep, ".")
        return f"{module.replace('.distributed.distributed_c10d', '.distributed')}.{function}"
    root = next((r for r in (*_LIBRARY[1:-1], _dir(os.getcwd()), _LIBRARY[-1]) if name.startswith(r)), None)
    return f"{os.path.relpath(name, root) if root else name}:{frame.f_lineno} in {function}"


def locate(thread_id: int, with_stack: bool = False) -> dict[str, Any]:
    """What a thread does: ``kind``, ``call`` (what it runs), ``site`` (its call into torch), ``user`` (its code)."""
    frame, frames = sys._current_frames().get(thread_id), []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if not frames or any(f.f_trace is not None or f.f_code.co_filename.endswith(("bdb.py", "pdb.py")) for f in frames):
        return {"kind": "debugger" if frames else "gone"}  # someone sits in pdb, or a tracer steps through
    files = [_file(f) for f in frames]
    ours = [not name.startswith(_LIBRARY) for name in files] + [True]
    block = files[: ours.index(True)]  # the innermost library frames: what runs on behalf of the user's code
    plain = [not (n.startswith(("<", _TORCH)) or (n.startswith(_STDLIB) and not n.startswith(_SITE))) for n in files]
    stack = [f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {_where(f).split(" in ")[-1]}' for f in frames]
    out = {
        "site": _where(frames[plain.index(True)]) if True in plain else None,  # user code, Lightning or lit_accel
        "user": _where(frames[ours.index(True)]) if ours.index(True) < len(frames) else None,
        "stack": "\n".join(stack[:60][::-1]) if with_stack else None,  # most recent call last, as tracebacks
    }
    if (hit := next((f for f, n in zip(frames, block) if n.startswith(_COLLECTIVE)), None)) is not None:
        return {**out, "kind": "collective", "call": _where(hit, torch_api=True)}
    if any(n.startswith(_AUTOGRAD) and f.f_code.co_name == "_engine_run_backward" for f, n in zip(frames, block)):
        return {**out, "kind": "backward", "call": "autograd backward"}
    if (hit := next((f for f, n in zip(frames, files) if n.startswith(_DATA)), None)) is not None:
        return {**out, "kind": "data", "call": _where(hit, torch_api=True)}  # in a DataLoader, or in its dataset
    hit = next((f for f, n in zip(frames, block) if n.startswith(_TORCH)), frames[0])
    return {**out, "kind": "running", "call": _where(hit, torch_api=True)}


@dataclass(frozen=True)
class RankState:
    """What one rank publishes every interval: its progress and, once its main thread sits still, where it is."""

    rank: int
    seq: int  # phase changes so far: ranks running the same program agree, so the smallest is furthest behind
    phase: str
    step: int | None
    stall_s: float  # seconds without progress
    allowance_s: float
    pid: int = 0
    host: str = ""
    kind: str = "running"
    call: str | None = None
    site: str | None = None
    user: str | None = None
    stack: str | None = None
    beat: int = 0
    status: Literal["running", "finished"] = "running"
    silent_s: float = 0.0  # set by the judge: seconds without a new state from this rank

    @property
    def overdue(self) -> bool:
        return self.stall_s > self.allowance_s


@dataclass(frozen=True)
class HangReport:
    """A verdict, the ranks it blames, the rank that judged and the last state of every rank (ordered by rank)."""

    verdict: Literal["stuck", "divergent", "waiting"]
    culprits: tuple[int, ...]
    states: tuple[RankState, ...]
    world_size: int
    judge: int = 0

    @property
    def key(self) -> tuple:
        """The stall it describes (the progress of the blamed ranks, or all): reported once, however long it lasts."""
        return tuple((s.rank, s.seq, s.status) for s in self.states if s.rank in self.culprits or not self.culprits)

    @classmethod
    def from_json(cls, data: bytes | str) -> HangReport:
        raw = json.loads(data)
        states = tuple(RankState(**s) for s in raw.pop("states"))
        return cls(**{**raw, "culprits": tuple(raw["culprits"]), "states": states})


def judge(states: dict[int, RankState], world_size: int, quiet_s: float, judge_rank: int = 0) -> HangReport | None:
    """The verdict; ``quiet_s``: seconds since any rank's progress or place last changed, as the judge saw it."""

    def report(verdict: Any, culprits: Any) -> HangReport:  # with the culprits' stacks only: every rank reads it
        kept = [
            s if s.rank in culprits else replace(s, stack=None) for s in sorted(states.values(), key=lambda s: s.rank)
        ]
        return HangReport(verdict, tuple(sorted(culprits)), tuple(kept), world_size, judge_rank)

    live = [s for s in states.values() if s.status == "running"]
    if not live or any(s.kind == "debugger" for s in live):
        return None
    running = [s for s in live if s.kind not in WAITING or s.silent_s]  # a silent rank may be frozen anywhere
    if stuck := [s for s in running if s.overdue]:  # several: the furthest behind (a device hang stalls the others)
        return report("stuck", [s.rank for s in stuck if s.seq == min(t.seq for t in stuck)])
    if running:
        return None  # a rank within its allowance: the others legitimately wait for it
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
    return report("divergent" if blamed else "waiting", () if len(blamed) == len(states) else blamed)


def rank_ranges(ranks: Any) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _doing(s: RankState, culprits: tuple[int, ...]) -> str:
    if s.status != "running":
        return "finished"
    waits = f" for rank {rank_ranges(culprits)}" if culprits and s.rank not in culprits else ""
    site = f", called from {s.site}" if s.site else ""
    text = {
        "collective": f"waiting{waits} in {s.call}{site}",
        "backward": f"waiting{waits} in autograd's backward (where DDP waits for its peers' gradients){site}",
        "data": f"waiting for the data pipeline in {s.call}" + (f", at {s.user}" if s.user else ""),
        "running": f"running your code at {s.user}" if s.user else f"running {s.call}{site}",
    }.get(s.kind, s.kind)
    return f"no new state for {s.silent_s:.0f} s; last seen {text}" if s.silent_s else text


_ADVICE = {
    "data": "the data pipeline: a deadlocked or dead DataLoader worker, a hung filesystem, or fewer batches here",
    "code": "your code at {user}: if its work is legitimate (evaluation, an upload on one rank), raise the allowance"
    " of phase '{phase}'; else what blocks it there: a lock, I/O, a rank-dependent branch, or a GPU sync (.item())",
    "library": "{call}: compilation, I/O or a GPU sync that does not return; if legitimate, raise phase '{phase}''s",
    "silent": "a process that stopped publishing (frozen, native code holding the GIL): `py-spy dump --pid PID`",
    "divergent": "control flow that differs between ranks: a collective under a condition on the rank, the data or a"
    " metric, a collective on some ranks only, or ranks with different numbers of batches",
    "waiting": "every rank waits in one collective: the network, a process outside the job, or a device (NCCL_DEBUG)",
}


def format_report(report: HangReport, exit_code: int | None) -> str:
    """The report the ranks concerned print; ``exit_code`` None when the job goes on."""
    culprits, states, ranks = report.culprits, report.states, rank_ranges(report.culprits)
    s = next((t for t in states if t.rank in culprits), states[0])
    head = {
        "stuck": f"rank {ranks} has made no progress for {s.stall_s:.1f} s in phase '{s.phase}' (step {s.step},"
        f" allowance {s.allowance_s:g} s)" + ("; the other ranks wait for it" if len(states) > 1 else ""),
        "divergent": "the ranks diverged, they wait in different places"
        + (f": rank {ranks} took another path" if culprits else ""),
        "waiting": f"every rank has waited {s.stall_s:.1f} s in the same place",
    }[report.verdict]  # fmt: skip
    advice = "silent" if s.silent_s else "data" if s.kind == "data" else "code" if s.user else "library"
    groups: dict[tuple, list[RankState]] = {}  # ranks in one place share a line, with the longest stall
    for t in states:
        where = "" if t.status != "running" else f"phase '{t.phase}' (step {t.step})"
        groups.setdefault((where, _doing(t, culprits)), []).append(t)
    lines = [f"HangWatchdog: {head}."]
    for (where, doing), group in groups.items():
        stall = f"{where} for {max(t.stall_s for t in group):.0f} s: " if where else ""
        lines.append(f"  rank {rank_ranges(t.rank for t in group)}: {stall}{doing}")
    if missing := set(range(report.world_size)) - {t.rank for t in states}:
        lines.append(f"  rank {rank_ranges(missing)}: never published (its watchdog did not start)")
    for t in (t for t in states if t.rank in culprits and t.stack):
        lines += [f"Main-thread stack of rank {t.rank} (pid {t.pid} on {t.host}), most recent call last:", t.stack]
    advice = advice if report.verdict == "stuck" else report.verdict
    lines.append("What to look at: " + _ADVICE[advice].format(user=s.user, phase=s.phase, call=s.call) + ".")
    lines.append(
        "Report only: the job goes on (hang_timeout= or on_hang='exit' would end it)."
        if exit_code is None
        else f"Ending every rank with exit code {exit_code} (the blocked collective would only fail at the process"
        " group's timeout); each blamed rank dumps all its threads to its own stderr."
    )
    return "\n".join(lines)
