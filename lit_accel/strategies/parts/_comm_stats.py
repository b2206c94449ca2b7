"""Counters of a strategy's gradient collectives (:class:`lit_accel.protocols.CommStats`), read at logging steps.

:class:`HookCommStats` holds AccelDDP's one counting rule: one round per synchronised backward, in which DDP
all-reduces every bucket once. A counting comm hook (a comm hook of the user's, or torch's all-reduce once a consumer
asked for exact timing with :meth:`HookCommStats.request_timing`) counts and times every bucket it reduces (counting
costs no device synchronisation; timing is resolved only in ``pop_elapsed_s``/``pop_exposed_s``); without a hook the
strategy counts the rounds, the layout gives the buckets and DDP's own sampled rounds the time
(``_bucket_rounds.BucketRounds``, read when the counters are). AccelFSDP's ``FSDPCommStats`` extends it. It satisfies
:class:`lit_accel.protocols.ExposedComm` too:
``pop_exposed_s`` is the time from the end of a backward's compute to the completion of its last gradient collective,
the part of the communication that overlap did not hide (with slower peers, the wait for them). The hook marks the end
of the compute with a callback queued on the backward pass at its first bucket, which the autograd engine runs before
DDP's ``finalize_backward``.
"""

# No ``from __future__ import annotations``: keep the module importable on its own for DDP's hook annotations check.
import threading
import time
from typing import Any

import torch

from lit_accel.utilities._compat import current_graph_task_id, queue_backward_callback

__all__ = ["HookCommStats"]

# Intervals kept for pop_elapsed_s; beyond this (nobody popped for thousands of collectives) they are folded into a
# number so that memory stays bounded. An EfficiencyMonitor pops at every logging step, far below it.
_MAX_PENDING = 4096


class HookCommStats:
    """Host-side counters of the gradient collectives issued through a counting comm hook (``counting_comm_hook``).

    AccelDDP's, whatever its ``comm_hook``; satisfies :class:`lit_accel.protocols.CommStats` and ``CommTiming``. The
    hook calls :meth:`start`, :meth:`open_round` and :meth:`finish` for each bucket; without a hook AccelDDP calls
    :meth:`count_round` after each synchronised backward.

    Attributes:
        calls: all-reduce collectives issued so far (cumulative; a Python ``int``).
        rounds: synchronised backward passes so far (each reduces every bucket once; cumulative).
        bytes: bytes those collectives put on the wire per rank, after any compression (cumulative; a Python
            ``int``). This is the payload size; a ring all-reduce moves about ``2 (n - 1) / n`` times it per rank
            (Patarasuk & Yuan, 2009).

    Only gradient all-reduces issued by DDP are counted: SyncBatchNorm's statistics and ``broadcast_buffers`` go
    through other collectives.
    """

    def __init__(self) -> None:
        self._calls = self._bytes = 0
        self.rounds: int = 0
        #: Whether a consumer asked for ``pop_elapsed_s``/``pop_exposed_s`` this fit (:meth:`request_timing`).
        self.timing_requested = False
        #: The rounds of a model counted without a hook (``BucketRounds``), folded into the totals when read.
        self.bucket_rounds: Any = None
        self._lock = threading.Lock()
        # Finished collectives as (start, end): floats from ``time.perf_counter`` on CPU, CUDA events on GPU. The
        # end is added by the future's callback, which may run on a backend thread: hence the lock.
        self._cpu_intervals: list[tuple[float, float]] = []
        self._cuda_intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._folded_s = 0.0  # time of intervals folded away while nobody popped
        # One entry per synchronised backward ("round"): when its compute ended and when its collectives finished.
        self._rounds: list[_Round] = []
        self._open_round: _Round | None = None
        self._folded_exposed_s = 0.0

    @property
    def calls(self) -> int:
        """All-reduce collectives issued so far (cumulative; a Python ``int``)."""
        self._fold()
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        self._fold()
        self._calls = value

    @property
    def bytes(self) -> int:
        """Payload bytes those collectives put on the wire per rank (cumulative; a Python ``int``)."""
        self._fold()
        return self._bytes

    @bytes.setter
    def bytes(self, value: int) -> None:
        self._fold()
        self._bytes = value

    # Pickled (``start_method="spawn"``) as the totals only: locks, CUDA events and DDP models do not travel.
    def __getstate__(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._calls, self._bytes = state["calls"], state["bytes"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(calls={self.calls}, bytes={self.bytes})"

    def request_timing(self) -> None:
        """Time every collective exactly (``pop_elapsed_s``, ``pop_exposed_s``): ask before the fit's first backward.

        AccelDDP decides in its ``on_train_start`` (after the callbacks'): without a request its default all-reduce
        runs with no Python hook, counted exactly and timed by estimate from DDP's sampled rounds (``BucketRounds``).
        """
        self.timing_requested = True

    def count_round(self) -> None:
        """A synchronised backward ended while no hook counts (``bucket_rounds``): its buckets, counted lazily."""
        self.rounds += 1  # the layout each round used follows from its number, when read

    def release_rounds(self) -> None:
        """Fold the rounds counted without a hook and stop counting that way (the fit ends, or a hook counts now)."""
        rounds, self.bucket_rounds = self.bucket_rounds, None
        if rounds is not None:
            calls, nbytes = rounds.release(self.rounds)
            self._calls, self._bytes = self._calls + calls, self._bytes + nbytes

    def _fold(self) -> None:
        rounds = self.bucket_rounds
        if rounds is not None and rounds.pending(self.rounds):
            calls, nbytes = rounds.fold(self.rounds)
            self._calls, self._bytes = self._calls + calls, self._bytes + nbytes

    def pop_elapsed_s(self) -> float:
        """Seconds during which at least one gradient collective was in flight, since the previous call.

        Overlapping collectives (several buckets in flight at once) are counted once: this is the union of their
        intervals, so it never exceeds wall-clock time. On CUDA the interval runs from the moment DDP hands the
        bucket to the hook (an event on the current stream) to the completion of the collective's future, and
        this call waits for those events: call it at logging steps only. Rounds counted without a hook add an
        estimate (``BucketRounds.pop_sampled_s``).
        """
        with self._lock:
            cpu, self._cpu_intervals = self._cpu_intervals, []
            cuda, self._cuda_intervals = self._cuda_intervals, []
            elapsed, self._folded_s = self._folded_s, 0.0
        for start, end in cuda:
            start.synchronize()
            end.synchronize()
        sampled = self.bucket_rounds.pop_sampled_s(self.rounds) if self.bucket_rounds is not None else 0.0
        return sampled + elapsed + _union_length(cpu) + _union_length(_cuda_spans(cuda))

    def pop_exposed_s(self) -> float:
        """Seconds this rank waited for its gradient collectives after its backward's compute ended, since the last pop.

        Per synchronised backward: from the end of its compute (a callback the first bucket queues on the backward
        pass, which the autograd engine runs after the last backward op and before DDP's ``finalize_backward``) to the
        completion of its last collective, or 0 when every collective finished before the compute did (fully
        hidden). A bucket handed over outside a backward pass counts from its hand-off. Call at logging steps only.
        Rounds counted without a hook add an estimate (``BucketRounds.pop_sampled_s``).
        """
        with self._lock:
            done = [r for r in self._rounds if r is not self._open_round]
            self._rounds = [r for r in self._rounds if r is self._open_round]
            exposed, self._folded_exposed_s = self._folded_exposed_s, 0.0
        sampled = self.bucket_rounds.pop_sampled_s(self.rounds, exposed=True) if self.bucket_rounds is not None else 0.0
        return sampled + exposed + sum(r.exposed_s() for r in done)

    def start(self, device: torch.device) -> Any:
        """Now, for a collective launched now (a host clock reading, or a CUDA event)."""
        return _mark(device)

    def open_round(self, device: torch.device) -> "_Round":
        """The round a bucket handed over now belongs to; the first bucket of a backward pass opens (counts) it."""
        task = current_graph_task_id()
        current = self._open_round
        if current is not None and current.task == task >= 0:
            with self._lock:
                current.pending += 1
            return current
        current = _Round(task)  # a new backward (a round left open by one that raised stays without an end)
        current.pending = 1
        self.rounds += 1
        with self._lock:
            self._rounds.append(current)
            if len(self._rounds) > _MAX_PENDING:
                self._fold_finished_rounds()
        self._open_round = current

        def compute_done() -> None:
            current.compute_end = _mark(device)
            if self._open_round is current:
                self._open_round = None

        if not queue_backward_callback(compute_done):  # no backward running: the compute is over already
            compute_done()
        return current

    def finish(self, start: Any, fut: torch.futures.Future, round_: "_Round | None" = None) -> Any:
        """The collective started at ``start`` (of ``round_``) completed: record its end; ``fut``'s value."""
        # Runs as the future's ``then`` callback, when the collective has completed (on CUDA: with the current
        # stream synchronised to the collective's, so an event recorded now marks its end on the device).
        end = self.record_end(start)
        if round_ is not None:
            with self._lock:
                round_.ends.append(end)
                round_.pending -= 1
        return fut.value()

    def record_end(self, start: Any) -> Any:
        """Record now as the end of a collective that started at ``start``; returns the end mark."""
        end = _mark(torch.device("cpu" if isinstance(start, float) else "cuda"))
        with self._lock:
            if isinstance(start, float):
                self._cpu_intervals.append((start, end))
                if len(self._cpu_intervals) > _MAX_PENDING:
                    self._folded_s += _union_length(self._cpu_intervals)
                    self._cpu_intervals = []
            else:
                self._cuda_intervals.append((start, end))
                if len(self._cuda_intervals) > _MAX_PENDING:
                    self._fold_finished_cuda()
        return end

    def _fold_finished_rounds(self) -> None:
        # Called with the lock held, when nobody popped for thousands of rounds: fold the finished ones (their events
        # completed: ``query`` does not block) into a number.
        finished = [r for r in self._rounds if r is not self._open_round and r.finished()]
        self._folded_exposed_s += sum(r.exposed_s() for r in finished)
        done = {id(r) for r in finished}
        self._rounds = [r for r in self._rounds if id(r) not in done]

    def _fold_finished_cuda(self) -> None:
        # Nobody popped for a long time: fold the collectives whose events have completed (``query`` does not
        # block) into a number, so the pending list stays bounded without a host sync on the training path.
        finished = [(s, e) for s, e in self._cuda_intervals if s.query() and e.query()]
        if finished:
            done = {id(e) for _, e in finished}
            self._folded_s += _union_length(_cuda_spans(finished))
            self._cuda_intervals = [(s, e) for s, e in self._cuda_intervals if id(e) not in done]


class _Round:
    """One synchronised backward: when its compute ended and when each of its collectives completed."""

    __slots__ = ("compute_end", "ends", "pending", "task")

    def __init__(self, task: int) -> None:
        self.task = task  # the backward pass (graph task) it belongs to; -1 outside one
        self.compute_end: Any = None  # a perf_counter float, or a CUDA event
        self.ends: list[Any] = []
        self.pending = 0  # collectives handed over and not completed yet

    def finished(self) -> bool:
        marks = [self.compute_end, *self.ends]
        return (
            self.pending == 0 and self.compute_end is not None and all(isinstance(m, float) or m.query() for m in marks)
        )

    def exposed_s(self) -> float:
        if self.compute_end is None or not self.ends:
            return 0.0
        if isinstance(self.compute_end, float):
            return max(0.0, max(self.ends) - self.compute_end)
        self.compute_end.synchronize()
        for end in self.ends:
            end.synchronize()
        return max(0.0, max(self.compute_end.elapsed_time(end) for end in self.ends) / 1e3)


def _mark(device: torch.device) -> Any:
    """Now, on the host clock, or as a CUDA event recorded on the current stream."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _cuda_spans(events: list[tuple[Any, Any]]) -> list[tuple[float, float]]:
    """Completed (start, end) CUDA event pairs as seconds relative to the first start."""
    if not events:
        return []
    reference = events[0][0]
    return [(reference.elapsed_time(s) / 1e3, reference.elapsed_time(e) / 1e3) for s, e in events]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total
