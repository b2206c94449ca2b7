"""``ProgressWatchdog``: name the rank that stopped making progress, where it is and who waits; report, or end the job.

A thread per rank publishes its progress, and where its main thread is (the stack decides, the phase is a hint), in
the process group's store; rank 0 turns them into one verdict and one report. Rules: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from types import FrameType
from typing import Any, Literal, NamedTuple

import torch

from lit_accel.utilities._compat import default_process_group_store
from lit_accel.utilities._validation import check_choice, check_number

__all__ = ["HANG_EXIT_CODE", "HangReport", "Progress", "ProgressWatchdog", "RankState"]

HANG_EXIT_CODE = 124  #: every rank's exit code when the watchdog ends a job (the ``timeout`` command's "timed out")
_STARTS = itertools.count()  # watchdog starts in this process: every rank starts its watchdogs in the same order


def _dir(path: str) -> str:
    return os.path.normcase(os.path.abspath(path)) + os.sep


_TORCH = _dir(os.path.dirname(torch.__file__))
_SITE = tuple({_dir(p) for key in ("purelib", "platlib") if (p := sysconfig.get_path(key))})
_STDLIB = tuple({_dir(p) for key in ("stdlib", "platstdlib") if (p := sysconfig.get_path(key))})
_LIBRARY = ("<", *_SITE, *_STDLIB, _TORCH, _dir(os.path.dirname(os.path.dirname(__file__))))  # and lit_accel
_COLLECTIVE = (_TORCH + os.path.join("distributed", ""), _TORCH + os.path.join("nn", "parallel", "distributed.py"))
_DATA, _AUTOGRAD = _TORCH + os.path.join("utils", "data", ""), _TORCH + os.path.join("autograd", "")


class Progress(NamedTuple):
    """The main thread's latest record: phase changes so far, the phase, its step and allowance, its start."""

    changes: int
    phase: str
    step: int | None
    allowance_s: float
    started: float  # time.monotonic()


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


def _file(frame: FrameType) -> str:
    name = frame.f_code.co_filename
    return name if name.startswith("<") else os.path.normcase(os.path.abspath(name))


def _where(frame: FrameType, api: bool = False) -> str:
    """``path:line in function``, relative to its root; with ``api`` a torch frame as ``torch.distributed.x``."""
    name, function = _file(frame), getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    if api and name.startswith(_TORCH) and name.endswith(".py"):
        module = os.path.relpath(name[:-3], os.path.dirname(_TORCH[:-1])).replace(os.sep, ".")
        return f"{module.replace('.distributed.distributed_c10d', '.distributed')}.{function}"
    root = next((r for r in (*_LIBRARY[1:-1], _dir(os.getcwd()), _LIBRARY[-1]) if name.startswith(r)), None)
    return f"{os.path.relpath(name, root) if root else name}:{frame.f_lineno} in {function}"


def locate(thread_id: int, with_stack: bool = False) -> dict[str, Any]:
    """Where a thread is, from its frames: the :class:`RankState` fields ``kind``, ``call``, ``site``, ``user``."""
    frames = [f for f, _ in traceback.walk_stack(frame)] if (frame := sys._current_frames().get(thread_id)) else []
    if not frames or any(f.f_trace is not None or f.f_code.co_filename.endswith(("bdb.py", "pdb.py")) for f in frames):
        return {"kind": "debugger" if frames else "gone"}  # someone sits in pdb, or a tracer steps through
    files = [_file(f) for f in frames]
    ours = [not name.startswith(_LIBRARY) for name in files] + [True]
    block = files[: ours.index(True)]  # the innermost library frames: what runs on behalf of the user's code
    plain = [not (n.startswith(("<", _TORCH)) or (n.startswith(_STDLIB) and not n.startswith(_SITE))) for n in files]
    out = {
        "site": _where(frames[plain.index(True)]) if True in plain else None,
        "user": _where(frames[ours.index(True)]) if ours.index(True) < len(frames) else None,
        # traceback's layout, most recent call last; source lines are never read (linecache on a hung filesystem)
        "stack": "\n".join(f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {_where(f).split(" in ")[-1]}'
                           for f in frames[:60][::-1]) if with_stack else None,
    }  # fmt: skip
    if (hit := next((f for f, n in zip(frames, block) if n.startswith(_COLLECTIVE)), None)) is not None:
        return {**out, "kind": "collective", "call": _where(hit, api=True)}
    if any(n.startswith(_AUTOGRAD) and f.f_code.co_name == "_engine_run_backward" for f, n in zip(frames, block)):
        return {**out, "kind": "collective", "call": "autograd's backward (where DDP waits for its peers' gradients)"}
    if (hit := next((f for f, n in zip(frames, files) if n.startswith(_DATA)), None)) is not None:
        return {**out, "kind": "data", "call": _where(hit, api=True)}  # in a DataLoader, or in its dataset
    hit = next((f for f, n in zip(frames, block) if n.startswith(_TORCH)), frames[0])
    return {**out, "kind": "running", "call": _where(hit, api=True)}


def judge(states: dict[int, RankState], quiet_s: float) -> HangReport | None:
    """The verdict, from states in rank order; ``quiet_s``: seconds since any rank's progress or place changed."""

    def report(verdict: Any, blamed: Any) -> HangReport:  # stacks of the blamed ranks only: every rank reads it
        kept = tuple(s if s.rank in blamed else replace(s, stack=None) for s in states.values())
        return HangReport(verdict, tuple(sorted(blamed)), kept)

    live = [s for s in states.values() if s.status == "running"]
    if not live or any(s.kind == "debugger" for s in live):
        return None
    running = [s for s in live if s.kind != "collective"]
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
    culprits, states, ranks = report.culprits, report.states, rank_ranges(report.culprits)
    s, advice = next((t for t in states if t.rank in culprits), states[0]), report.verdict
    if advice == "stuck":
        head = f"rank {ranks} has made no progress for {s.stall_s:.1f} s in phase '{s.phase}' (step {s.step}, allowance"
        head += f" {s.allowance_s:g} s)" + ("; the other ranks wait for it" if len(states) > 1 else "")
        advice = "data" if s.kind == "data" else "code" if s.user else "library"
    elif advice == "divergent":
        who = f": rank {ranks} took another path" if culprits else ""
        head = f"the ranks diverged, they wait in different places{who}"
    else:
        head = f"every rank has waited {s.stall_s:.1f} s in the same place"
    groups: dict[tuple, list[RankState]] = {}  # ranks in one place share a line, with the longest stall
    for t in states:
        where = f"phase '{t.phase}' (step {t.step})" if t.status == "running" else ""
        groups.setdefault((where, _doing(t, culprits) if where else "finished"), []).append(t)
    lines = [f"HangWatchdog: {head}."]
    for (where, doing), group in groups.items():
        stall = f"{where} for {max(t.stall_s for t in group):.0f} s: " if where else ""
        lines.append(f"  rank {rank_ranges(t.rank for t in group)}: {stall}{doing}")
    for t in (t for t in states if t.rank in culprits and t.stack):
        lines += [f"Main-thread stack of rank {t.rank} (pid {t.pid} on {t.host}), most recent call last:", t.stack]
    lines.append("What to look at: " + _ADVICE[advice].format(user=s.user, phase=s.phase, call=s.call) + ".")
    end = f"Ending every rank with exit code {exit_code}: a blocked collective fails only at the group's timeout."
    lines.append(end if exit_code else "Report only: the job goes on.")
    return "\n".join(lines)


def write_stderr(text: str) -> None:
    """Write to file descriptor 2 (no Python lock a stuck thread may hold), a line at a time (ranks share a pipe)."""
    with contextlib.suppress(OSError):
        for line in text.splitlines(keepends=True):
            os.write(2, line.encode(errors="replace"))


class ProgressWatchdog:
    """Watch this rank's progress and every other rank's; report a rank that stops progressing, or end the job.

    Example::

        watchdog = ProgressWatchdog(timeout=60)
        watchdog.start()  # after init_process_group
        for step, batch in enumerate(loader):
            watchdog.enter("step", step)
            train_step(batch)
        watchdog.stop()  # in a ``finally:``: after a verdict, a peer's exit makes the loop raise

    Args:
        timeout: seconds a phase may go without progress unless :meth:`enter` gives it another ``allowance``.
        interval: seconds between two publications of this rank's state (and rank 0's looks at the others').
        on_hang: ``"exit"`` ends every rank with :data:`HANG_EXIT_CODE` after the report; ``"report"`` prints it
            once per stall, on rank 0 and the blamed ranks.
    """

    def __init__(
        self,
        timeout: float = 30.0,
        *,
        interval: float = 1.0,
        on_hang: Literal["exit", "report"] = "exit",
        owner: str = "ProgressWatchdog",
    ) -> None:
        check_number(owner, "timeout", timeout, fix="pass the seconds a phase may take without progress, e.g. 60")
        check_number(owner, "interval", interval, fix="pass e.g. interval=1.0")
        check_choice(owner, "on_hang", on_hang, ("exit", "report"), fix="'exit'")
        self.timeout, self.interval, self.on_hang = float(timeout), float(interval), on_hang
        self.report: HangReport | None = None  #: the latest verdict
        self.progress = Progress(0, "idle", None, self.timeout, time.monotonic())  #: what :meth:`enter` recorded
        self.rank, self.world_size, self._thread, self._ending = 0, 1, None, False
        self._grace = 2 * self.interval + 0.5  # every rank reads a verdict within an interval: time to print it

    def enter(self, phase: str, step: int | None = None, allowance: float | None = None) -> None:
        """The main thread starts ``phase`` (of ``step``), with ``allowance`` or ``timeout``: one assignment, no I/O."""
        allowance = self.timeout if allowance is None else allowance
        self.progress = Progress(self.progress.changes + 1, phase, step, allowance, time.monotonic())

    def start(self, children: Sequence[Any] = ()) -> None:
        """Start watching, after ``init_process_group``; ``children``: launched ranks (``Popen``) to end with us."""
        import torch.distributed as dist

        store = default_process_group_store()
        if self._thread is not None or (store is None and os.environ.get("WORLD_SIZE", "1") != "1"):
            fix = "stop() it first, or start it after init_process_group (the ranks meet in its store)"
            raise RuntimeError(f"ProgressWatchdog.start(): already running, or no process group. Fix: {fix}.")
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if store is not None else (0, 1)
        run = [os.environ.get(f"TORCHELASTIC_{key}", "-") for key in ("RUN_ID", "RESTART_COUNT")]
        prefix = f"lit_accel/hang_watchdog/{run[0]}/{run[1]}/{next(_STARTS)}/"  # no earlier run's verdict is read
        self._store = dist.PrefixStore(prefix, store if store is not None else dist.HashStore())
        self._children, self._main, self._stop = list(children), threading.get_ident(), threading.Event()
        self._pid, self._host, self._last, self._waited = os.getpid(), socket.gethostname(), None, (-1, 0.0)
        self.report, self._ending, self._overdue, self._looking = None, False, False, False
        self._flags, self._handled = 0, 0
        self._present, self._seen = set(), {}  # rank 0: ranks that published; rank -> (its progress and place, since)
        self._thread = threading.Thread(target=self._run, name="lit_accel-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and tell the other ranks; after a verdict that ends the job, end this process now."""
        if self._ending:  # the loop raised (a peer's exit broke a collective) or even finished: the verdict stands
            self._end()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=2 * self.interval)
        if self._last is not None and not thread.is_alive():  # the last word: the others do not wait for this rank
            with contextlib.suppress(Exception):
                self._store.set(f"state/{self.rank}", json.dumps(asdict(replace(self._last, status="finished"))))
        self._store = None  # on rank 0 it keeps the store's server, and its port, alive: not beyond the group

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a store that fails (its host exited) must not end the thread
                self._tick()

    def _tick(self) -> None:
        state = self._last = self._observe()
        self._store.set(f"state/{self.rank}", json.dumps(asdict(state)))
        overdue = state.overdue and state.kind != "debugger"
        if overdue and not self._overdue:
            self._store.add("overdue", 1)  # tells rank 0 to look at every rank
        self._overdue, posted = overdue, int(self._store.add("verdicts", 0))
        if posted > self._handled:
            self._handled, raw = posted, json.loads(self._store.get(f"verdict/{posted}"))
            states = tuple(RankState(**s) for s in raw.pop("states"))
            self._handle(HangReport(**{**raw, "culprits": tuple(raw["culprits"]), "states": states}))
        if self.rank != 0:
            return  # rank 0 judges (O(1) store traffic per rank), from the first flag until no rank is overdue
        flags = int(self._store.add("overdue", 0))
        self._looking, self._flags = self._looking or overdue or flags != self._flags, flags
        if not self._looking:
            return
        states = {**self._read_states(), self.rank: state}
        self._looking = any(s.overdue for s in states.values())
        report = judge(*self._as_seen(states))  # in rank order: this rank's state was in the store already
        if report is not None and report.key != getattr(self.report, "key", None):  # once per stall
            self._handled = int(self._store.add("verdicts", 1))
            self._store.set(f"verdict/{self._handled}", json.dumps(asdict(report)))
            self._handle(report)

    def _observe(self) -> RankState:
        (seq, phase, step, allowance, since), now, where = self.progress, time.monotonic(), {}
        stall = now - since
        if stall >= self.interval:  # frames are read only once the main thread sits still
            where = locate(self._main, with_stack=stall >= allowance / 2)
            if where["kind"] == "collective":
                self._waited = (seq, now)
            elif self._waited[0] == seq:  # running again after a wait in this phase: the peer answered then
                stall = now - self._waited[1]
        return RankState(self.rank, seq, phase, step, round(stall, 3), allowance, self._pid, self._host, **where)

    def _read_states(self) -> dict[int, RankState]:
        present = [r for r in range(self.world_size) if r in self._present or self._store.check([f"state/{r}"])]
        self._present.update(present)  # multi_get would wait for a missing key
        values = self._store.multi_get([f"state/{r}" for r in present])
        return {r: RankState(**json.loads(v)) for r, v in zip(present, values)}

    def _as_seen(self, states: dict[int, RankState]) -> tuple[dict[int, RankState], float]:
        """The states on this clock (a rank that stops publishing keeps stalling), and the seconds since any changed."""
        now, seen = time.monotonic(), {}
        for rank, s in states.items():
            place = (s.seq, s.status, s.kind, s.call, s.site)
            if self._seen.get(rank, ((),))[0] != place:  # a first sighting counts from that rank's own stall
                self._seen[rank] = (place, now if rank in self._seen else now - s.stall_s)
            seen[rank] = replace(s, stall_s=max(s.stall_s, now - self._seen[rank][1]))
        return seen, now - max(self._seen[r][1] for r in states)

    def _handle(self, report: HangReport) -> None:
        self.report, ending, prefix = report, self.on_hang == "exit", f"[rank {self.rank}] "
        if ending or self.rank in report.culprits or self.rank == 0:  # rank 0 judged
            text = format_report(report, HANG_EXIT_CODE if ending else None)
            write_stderr("".join(prefix + line + "\n" for line in text.splitlines()))
        if ending:
            self._ending = True
            time.sleep(self._grace)
            self._end()

    def _end(self) -> None:
        """Kill the DataLoader workers (a blocked one would outlive us), let the launched ranks end theirs, exit."""
        for child in [*multiprocessing.active_children(), *self._children]:
            with contextlib.suppress(Exception):
                if child in self._children:
                    child.wait(self._grace)  # a launched rank ends itself, and its own DataLoader workers
                child.kill()
        os._exit(HANG_EXIT_CODE)  # no clean shutdown: the blocked collective would never return
