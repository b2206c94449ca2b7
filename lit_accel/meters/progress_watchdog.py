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
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from types import FrameType
from typing import Any, Literal, NamedTuple

import torch

from lit_accel.meters._hang_verdict import HangReport, RankState, format_report, judge, rank_ranges, write_stderr
from lit_accel.utilities._compat import default_process_group_store
from lit_accel.utilities._validation import check_choice, check_number

__all__ = [
    "HANG_EXIT_CODE",
    "HangReport",
    "Position",
    "Progress",
    "ProgressWatchdog",
    "RankState",
    "dataloader_workers",
    "format_report",
    "judge",
    "locate",
    "rank_ranges",
]

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
    """A record: phase changes so far, the phase, its step and allowance, its start, the source's count then."""

    changes: int
    phase: str
    step: int | None
    allowance_s: float
    started: float  # time.monotonic()
    position: int = 0  # Position.count when it was recorded (0 without a source)


class Position(NamedTuple):
    """Where a loop stands, read from its own counters by the watchdog's thread (:meth:`ProgressWatchdog.follow`)."""

    count: int  # grows at every move, and is the same on every rank at the same place
    phase: str
    step: int | None
    allowance_s: float


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
    if not frames or _traced(frames):
        return {"kind": "debugger" if frames else "gone"}  # someone sits in pdb, or a tracer steps through
    files = [_file(f) for f in frames]
    ours = [not name.startswith(_LIBRARY) for name in files] + [True]
    block = files[: ours.index(True)]  # the innermost library frames: what runs on behalf of the user's code
    out = {
        "site": _site(frames, files),
        "user": _where(frames[ours.index(True)]) if ours.index(True) < len(frames) else None,
        "stack": _stack(frames) if with_stack else None,
    }
    return {**out, **_activity(frames, files, block)}


def _site(frames: list[FrameType], files: list[str]) -> str | None:
    """The innermost frame in neither torch nor the standard library (installed packages count), or None."""
    plain = [not (n.startswith(("<", _TORCH)) or (n.startswith(_STDLIB) and not n.startswith(_SITE))) for n in files]
    return _where(frames[plain.index(True)]) if True in plain else None


def _traced(frames: list[FrameType]) -> bool:
    """Whether a debugger or a tracer is stepping through these frames (then nothing here is a hang)."""
    return any(f.f_trace is not None or f.f_code.co_filename.endswith(("bdb.py", "pdb.py")) for f in frames)


def _stack(frames: list[FrameType]) -> str:
    """The innermost 60 frames in traceback's layout, most recent call last.

    Source lines are never read: linecache could block on a hung filesystem.
    """
    return "\n".join(
        f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {_where(f).split(" in ")[-1]}'
        for f in frames[:60][::-1]
    )


def _activity(frames: list[FrameType], files: list[str], block: list[str]) -> dict[str, str]:
    """The ``kind`` and ``call`` of a thread's frames: a collective, a DataLoader, or running (where in torch).

    ``files``: each frame's file; ``block``: the innermost library frames' files.
    """
    if (hit := next((f for f, n in zip(frames, block) if n.startswith(_COLLECTIVE)), None)) is not None:
        return {"kind": "collective", "call": _where(hit, api=True)}
    if any(n.startswith(_AUTOGRAD) and f.f_code.co_name == "_engine_run_backward" for f, n in zip(frames, block)):
        return {"kind": "collective", "call": "autograd's backward (where DDP waits for its peers' gradients)"}
    if (hit := next((f for f, n in zip(frames, files) if n.startswith(_DATA)), None)) is not None:
        return {"kind": "data", "call": _where(hit, api=True)}  # in a DataLoader, or in its dataset
    hit = next((f for f, n in zip(frames, block) if n.startswith(_TORCH)), frames[0])
    return {"kind": "running", "call": _where(hit, api=True)}


class ProgressWatchdog:
    """Watch this rank's progress and every other rank's; report a rank that stops progressing, or end the job.

    Example::

        watchdog = ProgressWatchdog(timeout=60)
        watchdog.start()  # after init_process_group
        for step, batch in enumerate(loader):
            watchdog.enter("step", step)
            train_step(batch)
        watchdog.stop()  # in a ``finally:``: after a verdict, a peer's exit makes the loop raise

    A loop that counts its own progress needs no call per step: :meth:`follow` lets the thread read it.

    Args:
        timeout: seconds a phase may go without progress unless :meth:`enter` gives it another ``allowance``.
        interval: seconds between two publications of this rank's state (and rank 0's looks at the others').
        on_hang: ``"report"`` (the default) prints the report once per stall, on rank 0 and the blamed ranks;
            ``"exit"`` ends every rank with :data:`HANG_EXIT_CODE` after it (and this rank's DataLoader workers).
    """

    def __init__(
        self,
        timeout: float = 30.0,
        *,
        interval: float = 1.0,
        on_hang: Literal["exit", "report"] = "report",
        owner: str = "ProgressWatchdog",
    ) -> None:
        check_number(owner, "timeout", timeout, fix="pass the seconds a phase may take without progress, e.g. 60")
        check_number(owner, "interval", interval, fix="pass e.g. interval=1.0")
        check_choice(owner, "on_hang", on_hang, ("exit", "report"), fix="'report', or 'exit' to end the job")
        self.timeout, self.interval, self.on_hang = float(timeout), float(interval), on_hang
        self.report: HangReport | None = None  #: the latest verdict
        self.progress = Progress(0, "idle", None, self.timeout, time.monotonic())  #: what :meth:`enter` recorded
        self.rank, self.world_size, self._thread, self._ending = 0, 1, None, False
        self._source: Callable[[], Position] | None = None
        self._moved = (-1, 0.0)  # the source's count when the thread last saw it move, and when
        self._grace = 2 * self.interval + 0.5  # every rank reads a verdict within an interval: time to print it

    def enter(self, phase: str, step: int | None = None, allowance: float | None = None) -> None:
        """The main thread starts ``phase`` (of ``step``), with ``allowance`` or ``timeout``: one assignment, no I/O.

        With a source (:meth:`follow`) the phase holds until the source's count moves on.
        """
        allowance = self.timeout if allowance is None else allowance
        position = 0 if self._source is None else self._source().count
        self.progress = Progress(self.progress.changes + 1, phase, step, allowance, time.monotonic(), position)

    def follow(self, source: Callable[[], Position] | None) -> None:
        """Read progress from ``source`` (``None``: stop), from the watchdog's thread at every interval.

        A loop whose counters tell where it is (Lightning's progress tracking) then costs no call per step; a move is
        seen within an interval. :meth:`enter` still marks what the counters do not show (validation, a checkpoint).
        """
        self._source, self._moved = source, (-1, 0.0)

    def current(self) -> Progress:
        """The record the thread judges: the latest :meth:`enter`, or the source's position once it has moved past."""
        return self._current(time.monotonic(), seen=False)

    def _current(self, now: float, seen: bool = True) -> Progress:
        event, source = self.progress, self._source
        if source is None or (position := source()).count == event.position:
            return event
        if self._moved[0] != position.count:  # the thread times a move from when it first sees it
            if not seen:
                return Progress(event.changes, *position[1:], now, position.count)
            self._moved = (position.count, now)
        return Progress(event.changes, *position[1:], self._moved[1], position.count)

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
        self._overdue = overdue
        self._take_verdict()
        if self.rank == 0:  # rank 0 judges (O(1) store traffic per rank), from the first flag until no rank is overdue
            self._judge_ranks(state, overdue)

    def _take_verdict(self) -> None:
        """Handle a verdict rank 0 posted since the last tick, if any."""
        posted = int(self._store.add("verdicts", 0))
        if posted > self._handled:
            self._handled, raw = posted, json.loads(self._store.get(f"verdict/{posted}"))
            states = tuple(RankState(**s) for s in raw.pop("states"))
            self._handle(HangReport(**{**raw, "culprits": tuple(raw["culprits"]), "states": states}))

    def _judge_ranks(self, state: RankState, overdue: bool) -> None:
        """Rank 0: while any rank is overdue, judge every rank's state and post a new stall's verdict once."""
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
        now, where = time.monotonic(), {}
        changes, phase, step, allowance, since, position = self._current(now)
        seq, stall = changes + position, now - since  # both grow as the rank moves on: ranks at one place agree
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
        """Kill this rank's DataLoader workers (a blocked one would outlive us), then exit; a launcher exits first.

        Lightning's launcher thread SIGKILLs every rank, itself included, once it sees a launched rank exit with a
        non-zero code: had a launched rank exited first, the job's exit code would read -9, not the verdict's. So each
        rank marks that it is done in the store; the launcher waits for its ranks' marks (killing the ones stuck past
        the grace), exits, and they exit when they see it gone. Only the processes the job owns are killed.
        """
        for worker in dataloader_workers():
            with contextlib.suppress(Exception):
                worker.kill()
        with contextlib.suppress(Exception):
            self._store.set(f"ended/{self._host}/{self._pid}", "1")
        launcher = os.getppid()
        if self._children:
            self._end_children()
        elif any(s.pid == launcher and s.host == self._host for s in getattr(self.report, "states", ())):
            deadline = time.monotonic() + 2 * self._grace  # bounded: a launcher that never exits must not keep us
            while os.getppid() == launcher and time.monotonic() < deadline:
                time.sleep(0.02)
        os._exit(HANG_EXIT_CODE)  # no clean shutdown: the blocked collective would never return

    def _end_children(self) -> None:
        """The launcher: wait a grace for its ranks to mark the end of their work; kill those that did not."""
        pending, deadline = list(self._children), time.monotonic() + self._grace
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = [child for child in pending if child.poll() is None and not self._has_ended(child.pid)]
        for child in pending:  # stuck beyond its own watchdog's reach
            with contextlib.suppress(Exception):
                child.kill()

    def _has_ended(self, pid: int) -> bool:
        try:
            return self._store.check([f"ended/{self._host}/{pid}"])
        except Exception:  # a store that fails cannot tell: the grace decides
            return False


def dataloader_workers() -> list[Any]:
    """This process's live DataLoader workers: the ``multiprocessing`` children named by torch's worker loop.

    ``torch.utils.data._utils.worker._worker_loop`` names its thread ``pt_data_worker``
    (``torch.multiprocessing._set_thread_name``), which Linux shows in ``/proc/<pid>/comm``; ``Process`` drops its
    target once started. Other children of the process (a user's own, a logger's) are not among them; without
    ``/proc`` none is found (a worker then ends by itself once it sees its parent gone).
    """

    def named_by_torch(pid: int | None) -> bool:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                return comm.read().strip() == "pt_data_worker"
        except OSError:
            return False

    return [child for child in multiprocessing.active_children() if named_by_torch(child.pid)]
