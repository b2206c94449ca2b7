"""``ProgressWatchdog``: find the rank that stopped making progress, show where it is, and end the job in seconds.

Lightning-free: any training loop (raw PyTorch, Fabric, Lightning through :class:`~lit_accel.callbacks.hang_watchdog.
HangWatchdog`) calls :meth:`ProgressWatchdog.enter` at each phase change. That is one tuple assignment on the main
thread: no I/O, no collective, no device sync. A daemon thread per rank publishes the rank's progress once per
``interval`` through a side channel that does not depend on the blocked collective (``_hang_channels.py``), inspects
its own main thread's frames once the rank has stalled, and rank 0 (or any rank that is itself overdue) turns the
states into a verdict (``_hang_diagnosis.py``). docs/reliability.md (When a rank hangs) explains the design and
its limits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal, NamedTuple

from lit_accel.callbacks._hang_channels import Channel, FileChannel, LocalChannel, StoreChannel, open_store_client
from lit_accel.callbacks._hang_diagnosis import WAITING_KINDS, HangReport, RankState, diagnose, format_report
from lit_accel.callbacks._hang_exit import dump_threads, end_process, register_dump_signal, write_stderr
from lit_accel.callbacks._stack_inspection import format_stack, inspect_thread
from lit_accel.utilities._compat import default_process_group_store
from lit_accel.utilities._validation import check_choice, check_number

__all__ = ["HANG_EXIT_CODE", "Progress", "ProgressWatchdog"]

#: Exit code of every rank of a job the watchdog ends (the ``timeout`` command's convention for "timed out").
HANG_EXIT_CODE = 124
_GENERATIONS = itertools.count()  # watchdog starts in this process; every rank starts its watchdogs in the same order
_monotonic = time.monotonic


class Progress(NamedTuple):
    """The main thread's latest record: phase changes so far, the phase, its step and allowance, its start."""

    changes: int
    phase: str
    step: int | None
    allowance_s: float
    started: float  # time.monotonic()


class ProgressWatchdog:
    """Watch this rank's progress and every other rank's; report and end the job when one stops progressing.

    Example::

        watchdog = ProgressWatchdog(timeout=30)
        watchdog.start()                    # after init_process_group (or pass directory= without one)
        for step, batch in enumerate(loader):
            watchdog.enter("forward", step)
            loss = model(batch)
            watchdog.enter("backward", step)
            loss.backward()
            watchdog.enter("optimizer_step", step)
            opt.step()
            watchdog.enter("data", step + 1)
        watchdog.stop()

    Args:
        timeout: seconds a phase may go without progress unless :meth:`enter` gives it another ``allowance``.
        interval: seconds between two publications of this rank's state (and checks of the others').
        on_hang: ``"exit"`` ends every rank with :data:`HANG_EXIT_CODE` after the report; ``"report"`` only reports
            (the job then waits for the collective timeout; ``report`` holds the verdict).
        directory: a directory shared by the ranks of one node, used when there is no process group.
        grace: seconds the ranks wait for each other to print the report before exiting.

    Raises:
        TypeError, ValueError: an argument has the wrong type or value.
    """

    def __init__(
        self,
        timeout: float = 30.0,
        *,
        interval: float = 1.0,
        on_hang: Literal["exit", "report"] = "exit",
        directory: str | os.PathLike | None = None,
        grace: float = 5.0,
        owner: str = "ProgressWatchdog",
    ) -> None:
        fix = "pass the seconds a phase may take without progress, e.g. timeout=30"
        check_number(owner, "timeout", timeout, fix=fix)
        check_number(owner, "interval", interval, fix="pass e.g. interval=1.0")
        check_number(owner, "grace", grace, fix="pass e.g. grace=5.0")
        check_choice(owner, "on_hang", on_hang, ("exit", "report"), fix="'exit'")
        if interval >= timeout:
            raise ValueError(
                f"{owner}(interval={interval!r}): must be below timeout={timeout!r}, or a hang cannot be seen in time."
                f" Fix: pass interval={min(1.0, timeout / 4):g} or raise the timeout."
            )
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"{owner}(directory={directory!r}): expected a path or None. Fix: pass a str or Path.")
        self.timeout, self.interval, self.on_hang, self.grace = float(timeout), float(interval), on_hang, float(grace)
        self.directory = None if directory is None else Path(directory)
        self.report: HangReport | None = None
        self.rank, self.world_size = 0, 1
        # (phase changes, phase, step, allowance, monotonic start): one assignment, so the thread never reads half
        self._mark: tuple[int, str, int | None, float, float] = (0, "idle", None, self.timeout, _monotonic())
        self._thread: threading.Thread | None = None
        self._ending = threading.Event()  # set once a verdict makes this watchdog end the process
        self._silent_after = max(5.0 * self.interval, 5.0)

    # ------------------------------------------------------------------------------------------ main thread

    def enter(self, phase: str, step: int | None = None, allowance: float | None = None) -> None:
        """Record that the main thread starts ``phase`` (of ``step``); ``allowance`` overrides ``timeout`` for it."""
        self._mark = (self._mark[0] + 1, phase, step, self.timeout if allowance is None else allowance, _monotonic())

    def done(self) -> None:
        """Record that the current phase ended and the rank is between phases (watched with ``timeout``)."""
        self.enter("idle")

    def on_exception(self) -> None:
        """Call from the training loop's exception handler: while the watchdog ends the job, block until it has.

        Ranks exit together after the report; a peer exiting first makes this rank's blocked collective raise, an
        error that is a consequence and must not end the process before its report is printed.
        """
        if self._ending.is_set():
            time.sleep(2 * self.grace + 5.0)  # the watchdog thread calls os._exit meanwhile

    @property
    def progress(self) -> Progress:
        """What :meth:`enter` recorded last."""
        return Progress(*self._mark)

    @property
    def running(self) -> bool:
        """Whether the watchdog thread runs (between :meth:`start` and :meth:`stop`)."""
        return self._thread is not None

    def start(
        self, rank: int | None = None, world_size: int | None = None, children: Sequence[subprocess.Popen] = ()
    ) -> None:
        """Start watching: the default process group's store, else ``directory``, else a single process.

        ``rank``/``world_size`` default to the process group's (or ``RANK``/``WORLD_SIZE``); ``children`` are ranks
        this process launched (Lightning's popen launcher): they are killed if they outlive the grace period.
        """
        if self._thread is not None:
            raise RuntimeError("ProgressWatchdog.start(): already running. Fix: call stop() before starting again.")
        store = default_process_group_store()
        if store is not None:
            import torch.distributed as dist

            rank, world_size = dist.get_rank(), dist.get_world_size()
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        generation = next(_GENERATIONS)
        if world_size == 1:
            self._channel: Channel = LocalChannel()
        elif store is not None:
            self._channel = StoreChannel(open_store_client(store, 2 * self._silent_after), generation, world_size)
        elif self.directory is not None:
            self._channel = FileChannel(self.directory, generation, world_size)
        else:
            raise RuntimeError(
                f"ProgressWatchdog.start(): world_size={world_size} without a torch.distributed process group or a"
                " directory to exchange states. Fix: start it after init_process_group, or pass directory=."
            )
        self.rank, self.world_size, self.report = rank, world_size, None
        self._children = list(children)
        self._main_id, self._pid, self._host = threading.get_ident(), os.getpid(), socket.gethostname()
        self._beat, self._overdue, self._seen_overdue, self._looking = 0, False, 0, False
        self._waited = (-1, 0.0)  # (phase changes, time) when the main thread was last seen waiting
        self._beats: dict[int, tuple[int | None, float]] = {}
        self._changes: dict[int, tuple[tuple, float]] = {}
        self._last: RankState | None = None
        self._dump_signal = register_dump_signal()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lit_accel-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; tell the other ranks this one finished (so they do not wait for it)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self.enter("stopping")  # a tick running now must not find the main thread "stalled" inside stop()
        self._stop.set()
        thread.join(timeout=2 * self.interval)
        if self._last is not None and not thread.is_alive():
            report = None
            with contextlib.suppress(Exception):
                self._channel.publish(replace(self._last, status="stopped", beat=self._last.beat + 1))
                report = None if self.report is not None else self._channel.read_report()
            if report is not None:  # posted after this rank's last look: report it like the others did
                self._handle(report)
        self._channel.close()
        if self._dump_signal is not None:
            faulthandler.unregister(self._dump_signal)

    # ------------------------------------------------------------------------------------------ watchdog thread

    def _run(self) -> None:
        next_tick, errors = _monotonic(), 0
        while not self._stop.is_set():
            try:
                report = self._tick()
                errors = 0
            except Exception as err:  # a broken channel must not kill the thread; say so once
                report, errors = None, errors + 1
                if errors == 3:
                    write_stderr(f"[rank {self.rank}] HangWatchdog: side channel failing ({err!r}); retrying.\n")
            if report is not None:
                self._handle(report)
            next_tick += self.interval
            self._stop.wait(max(0.0, next_tick - _monotonic()))

    def _tick(self) -> HangReport | None:
        seq, phase, step, allowance, since = self._mark
        now = _monotonic()
        stall = now - since
        fields = {}
        if stall >= self.interval:  # frames are read only once the main thread sits still
            location, frame = inspect_thread(self._main_id)
            fields = location._asdict()
            if location.kind in WAITING_KINDS:
                self._waited = (seq, now)
            elif self._waited[0] == seq:  # running again after a wait in this phase: the peer answered
                stall = now - self._waited[1]
            if stall >= allowance / 2:
                fields["stack"] = format_stack(frame)
        self._beat += 1
        wall = time.time() - stall
        state = RankState(
            self.rank,
            self._pid,
            self._host,
            seq,
            phase,
            step,
            round(stall, 3),
            allowance,
            wall,
            beat=self._beat,
            **fields,
        )
        self._channel.publish(state)
        self._last = state
        overdue = state.overdue and state.kind != "debugger"
        if overdue and not self._overdue:
            self._channel.flag_overdue()
        self._overdue = overdue
        if self.report is not None:
            return None
        report = self._channel.read_report()
        # Rank 0 judges. Another rank judges only while it is overdue itself and rank 0 has gone quiet or finished,
        # and until then reads rank 0's state alone: O(1) store traffic per waiting rank, whatever the world size.
        judge = self._someone_overdue() if self.rank == 0 else overdue and self._coordinator_gone(now)
        if report is None and judge:
            states = self._channel.read_states()
            states[self.rank] = state
            self._looking = any(s.overdue for s in states.values())
            silent = self._silent_ranks(states, now)
            verdict = diagnose(states, self.world_size, silent, self._quiet_s(states, now))
            if verdict is not None:
                report = self._channel.post_report(verdict)
        return report

    def _someone_overdue(self) -> bool:
        count = self._channel.overdue_count()
        if count < 0 or count != self._seen_overdue:
            self._seen_overdue, self._looking = count, True
        return self._looking

    def _quiet_s(self, states: dict[int, RankState], now: float) -> float:
        """Seconds since any rank's state last changed, on this rank's clock.

        A first sighting counts from the rank's own stall, measured on its own clock: no wall clocks are compared
        between hosts.
        """
        for rank, s in states.items():
            signature = (s.seq, s.status, s.kind, s.call, s.site)
            if rank not in self._changes or self._changes[rank][0] != signature:
                self._changes[rank] = (signature, now - s.stall_s if rank not in self._changes else now)
        return now - max((self._changes[r][1] for r in states), default=now)

    def _coordinator_gone(self, now: float) -> bool:
        state = self._channel.read_state(0)
        self._silent_ranks({} if state is None else {0: state}, now, ranks=(0,))
        return (state is not None and state.status != "running") or now - self._beats[0][1] > self._silent_after

    def _silent_ranks(self, states: dict[int, RankState], now: float, ranks: Sequence[int] = ()) -> list[int]:
        silent = []
        for rank in ranks or range(self.world_size):
            state = states.get(rank)
            beat = None if state is None else state.beat
            if rank not in self._beats or self._beats[rank][0] != beat:
                self._beats[rank] = (beat, now)
            fresh = now - self._beats[rank][1] <= self._silent_after
            if rank != self.rank and not fresh and (state is None or state.status == "running"):
                silent.append(rank)
        return silent

    def _handle(self, report: HangReport) -> None:
        self.report = report
        exit_code = None if self.on_hang == "report" else HANG_EXIT_CODE
        if exit_code is not None:
            self._ending.set()
        prefix = f"[rank {self.rank}] "
        text = format_report(report, exit_code)
        write_stderr("".join(prefix + line + "\n" for line in text.splitlines()))
        if self.rank in report.culprits or not report.culprits:
            dump_threads(prefix, self._dump_signal)
        if exit_code is not None:
            self._finish(exit_code)

    def _finish(self, exit_code: int) -> None:
        """Exit once every live rank has printed the report (at most ``grace`` seconds), with the child processes.

        The first rank to exit makes its peers' blocked collectives fail, and a main thread that raises could end its
        process before its watchdog has printed anything: hence the barrier, and :meth:`on_exception`.
        """
        report = self.report
        live = sum(s.status == "running" and s.rank not in report.silent for s in report.states)
        with contextlib.suppress(Exception):
            self._channel.publish(replace(self._last, status="reported", beat=self._last.beat + 1))
            self._channel.arrive_exit(self.rank)
        deadline = _monotonic() + self.grace
        while _monotonic() < deadline:
            try:
                if self._channel.exit_count() >= live:
                    break
            except Exception:  # the store's host (rank 0) has exited: nobody is left to wait for
                break
            time.sleep(0.02)
        end_process(exit_code, self._children, self.grace)
