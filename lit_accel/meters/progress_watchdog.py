"""``ProgressWatchdog``: name the rank that stopped making progress and where it is; report it, or end the job.

A daemon thread per rank publishes the rank's progress in the default process group's store, which keeps answering
while collectives block. docs/reliability.md (When a rank hangs) explains the design and its limits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any, Literal, NamedTuple

from lit_accel.meters._hang_verdict import WAITING, HangReport, RankState, format_report, judge, locate
from lit_accel.utilities._compat import default_process_group_store
from lit_accel.utilities._validation import check_choice, check_number

__all__ = ["HANG_EXIT_CODE", "Progress", "ProgressWatchdog"]

HANG_EXIT_CODE = 124  #: every rank's exit code when the watchdog ends a job (the ``timeout`` command's "timed out")
_STARTS = itertools.count()  # watchdog starts in this process: every rank starts its watchdogs in the same order


class Progress(NamedTuple):
    """The main thread's latest record: phase changes so far, the phase, its step and allowance, its start."""

    changes: int
    phase: str
    step: int | None
    allowance_s: float
    started: float  # time.monotonic()


def write_stderr(text: str) -> None:
    """Write to file descriptor 2 (no Python lock a stuck thread may hold), a line at a time (ranks share a pipe)."""
    with contextlib.suppress(OSError):
        for line in text.splitlines(keepends=True):
            os.write(2, line.encode(errors="replace"))


class ProgressWatchdog:
    """Watch this rank's progress and every other rank's; report a rank that stops progressing, or end the job.

    :meth:`enter` is one assignment on the main thread: no I/O, no collective, no device sync.

    Example::

        with ProgressWatchdog(timeout=60) as watchdog:  # after init_process_group
            for step, batch in enumerate(loader):
                watchdog.enter("forward", step)
                loss = model(batch)
                watchdog.enter("backward", step)
                loss.backward()
                watchdog.enter("optimizer_step", step)
                opt.step()
                watchdog.enter("data", step + 1)

    Args:
        timeout: seconds a phase may go without progress unless :meth:`enter` gives it another ``allowance``.
        interval: seconds between two publications of this rank's state (and looks at the others').
        on_hang: ``"exit"`` ends every rank with :data:`HANG_EXIT_CODE` after the report; ``"report"`` prints it once
            per stall on the judging and the blamed ranks, and the job goes on (``report`` holds the verdict).
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
        if interval >= timeout:
            raise ValueError(
                f"{owner}(interval={interval!r}): must be below timeout={timeout!r}, or a hang cannot be seen in time."
                f" Fix: pass interval={min(1.0, timeout / 4):g} or raise the timeout."
            )
        self.timeout, self.interval, self.on_hang = float(timeout), float(interval), on_hang
        self.report: HangReport | None = None  #: the latest verdict
        self.progress = Progress(0, "idle", None, self.timeout, time.monotonic())  #: what :meth:`enter` recorded
        self.rank, self.world_size, self._thread, self._ending = 0, 1, None, False
        self._silent_after = max(5.0 * self.interval, 5.0)  # a rank without a new state for this long is silent

    def enter(self, phase: str, step: int | None = None, allowance: float | None = None) -> None:
        """Record that the main thread starts ``phase`` (of ``step``); ``allowance`` overrides ``timeout`` for it."""
        allowance = self.timeout if allowance is None else allowance
        self.progress = Progress(self.progress.changes + 1, phase, step, allowance, time.monotonic())

    @property
    def running(self) -> bool:
        """Whether the watchdog thread runs (between :meth:`start` and :meth:`stop`)."""
        return self._thread is not None

    def __enter__(self) -> ProgressWatchdog:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, children: Sequence[Any] = ()) -> None:
        """Start watching, after ``init_process_group``; ``children``: launched ranks (``Popen``) to kill at the end."""
        import torch.distributed as dist

        if self._thread is not None:
            raise RuntimeError("ProgressWatchdog.start(): already running. Fix: call stop() before starting again.")
        store = default_process_group_store()
        if store is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                f"ProgressWatchdog.start(): WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group, whose store"
                " the ranks share. Fix: start the watchdog after torch.distributed.init_process_group."
            )
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if store is not None else (0, 1)
        run = [os.environ.get(f"TORCHELASTIC_{key}", "-") for key in ("RUN_ID", "RESTART_COUNT")]
        prefix = f"lit_accel/hang_watchdog/{run[0]}/{run[1]}/{next(_STARTS)}/"  # no earlier run's verdict is read
        self._store = dist.PrefixStore(prefix, store if store is not None else dist.HashStore())
        self._children, self._main, self._stop = list(children), threading.get_ident(), threading.Event()
        self._pid, self._host = os.getpid(), socket.gethostname()
        self.report, self._ending, self._beat, self._waited, self._last = None, False, 0, (-1, 0.0), None
        self._overdue, self._flags, self._looking, self._handled, self._posted = False, 0, False, 0, ()
        self._present: set[int] = set()
        self._seen: dict[int, tuple[tuple, float]] = {}  # as judge: rank -> (its progress and place, since when)
        self._beats: dict[int, tuple[int, float]] = {}  # as judge: rank -> (its last beat, first seen)
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
        if self._last is not None and not thread.is_alive():
            with contextlib.suppress(Exception):
                last = replace(self._last, beat=self._last.beat + 1, status="finished", stack=None)
                self._store.set(f"state/{self.rank}", json.dumps(asdict(last)))

    # ------------------------------------------------------------------------------------------ watchdog thread

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self._tick()
                failures = 0
            except Exception as err:  # a store that fails must not kill the thread; say so once
                failures += 1
                if failures == 3:
                    write_stderr(f"[rank {self.rank}] HangWatchdog: the store fails ({err!r}); retrying.\n")

    def _tick(self) -> None:
        state = self._last = self._observe()
        self._store.set(f"state/{self.rank}", json.dumps(asdict(state)))
        overdue = state.overdue and state.kind != "debugger"
        if overdue and not self._overdue:
            self._store.add("overdue", 1)  # tells rank 0 to look at every rank
        self._overdue, posted = overdue, int(self._store.add("verdicts", 0))
        if posted > self._handled:
            self._handled = posted
            self._handle(HangReport.from_json(self._store.get(f"verdict/{posted}")))
        if self.rank == 0:  # rank 0 judges from the first flag until no rank is overdue
            flags = int(self._store.add("overdue", 0))
            self._looking, self._flags = self._looking or overdue or flags != self._flags, flags
        else:  # another rank only while it is overdue and rank 0 finished or went quiet; until then it reads rank 0
            zero = self._read_states([0]).get(0) if overdue else None
            gone = zero is None or zero.status != "running" or self._age(zero) > self._silent_after
            self._looking = overdue and gone
        if not self._looking:
            return
        states = {**self._read_states(range(self.world_size)), self.rank: state}
        self._looking = any(s.overdue for s in states.values())
        report = judge(*self._as_seen(states), self.rank)
        if report is not None and report.key != self._posted:  # once per stall
            self._posted, self._handled = report.key, int(self._store.add("verdicts", 1))
            self._store.set(f"verdict/{self._handled}", json.dumps(asdict(report)))
            self._handle(report)

    def _observe(self) -> RankState:
        seq, phase, step, allowance, since = self.progress
        now = time.monotonic()
        stall, where = now - since, {}
        if stall >= self.interval:  # frames are read only once the main thread sits still
            where = locate(self._main, with_stack=stall >= allowance / 2)
            if where["kind"] in WAITING:
                self._waited = (seq, now)
            elif self._waited[0] == seq:  # running again after a wait in this phase: the peer answered then
                stall = now - self._waited[1]
        self._beat += 1
        return RankState(self.rank, seq, phase, step, round(stall, 3), allowance, self._pid, self._host,
                         beat=self._beat, **where)  # fmt: skip

    def _read_states(self, ranks: Sequence[int]) -> dict[int, RankState]:
        present = [r for r in ranks if r in self._present or self._store.check([f"state/{r}"])]
        self._present.update(present)  # multi_get would wait for a missing key
        values = self._store.multi_get([f"state/{r}" for r in present]) if present else []
        return {s.rank: s for s in (RankState(**json.loads(v)) for v in values)}

    def _age(self, state: RankState) -> float:
        """Seconds since this rank's state last changed, on this rank's clock (no clocks are compared)."""
        now = time.monotonic()
        if self._beats.get(state.rank, (None,))[0] != state.beat:
            self._beats[state.rank] = (state.beat, now)
        return 0.0 if state.status != "running" else now - self._beats[state.rank][1]

    def _as_seen(self, states: dict[int, RankState]) -> tuple[dict[int, RankState], int, float]:
        """The states as the judge sees them (a silent rank keeps stalling), and the seconds since any changed."""
        now, seen = time.monotonic(), {}
        for rank, s in states.items():
            age = self._age(s)
            seen[rank] = replace(s, stall_s=s.stall_s + age, silent_s=age if age > self._silent_after else 0.0)
            place = (s.seq, s.status, s.kind, s.call, s.site)
            if self._seen.get(rank, ((),))[0] != place:
                self._seen[rank] = (place, now if rank in self._seen else now - s.stall_s)  # first: its own stall
        return seen, self.world_size, now - max(self._seen[r][1] for r in states)

    def _handle(self, report: HangReport) -> None:
        self.report, ending, prefix = report, self.on_hang == "exit", f"[rank {self.rank}] "
        if ending or self.rank in report.culprits or self.rank == report.judge:
            text = format_report(report, HANG_EXIT_CODE if ending else None)
            write_stderr("".join(prefix + line + "\n" for line in text.splitlines()))
        if not ending:
            return
        self._ending = True
        if self.rank in report.culprits or not report.culprits:
            write_stderr(f"{prefix}HangWatchdog: all threads of this rank (pid {self._pid}), most recent call first:\n")
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=2, all_threads=True)
        time.sleep(2 * self.interval + 0.5)  # every rank reads the verdict within an interval: let each print it
        self._end()

    def _end(self) -> None:
        """Kill the DataLoader workers and the launched ranks (a blocked one would outlive us) and exit."""
        for child in [*multiprocessing.active_children(), *self._children]:
            with contextlib.suppress(Exception):
                child.kill()
        os._exit(HANG_EXIT_CODE)  # no clean shutdown: the blocked collective would never return
