"""Counters of a strategy's gradient collectives (:class:`lit_accel.protocols.CommStats`), read at logging steps.

* :class:`HookCommStats`: filled by a counting comm hook, which counts and times every bucket it reduces (counting
  costs no device synchronisation; timing is resolved only in ``pop_elapsed_s``/``pop_exposed_s``).
* :class:`DDPLoggingCommStats`: DDP's built-in C++ all-reduce with no Python hook (a Python hook costs about a
  millisecond per step on a CPU ViT: ``benchmarks/RESULTS.md``, section 1); the strategy counts all-reduce *rounds*
  with one integer increment each and the rest comes from DDP's own logging when the counters are read.

Both satisfy :class:`lit_accel.protocols.ExposedComm` too: ``pop_exposed_s`` is the time from the end of a backward's
compute to the completion of its last gradient collective, the part of the communication that overlap did not hide
(with slower peers, the wait for them). The hook marks the end of the compute with a callback queued on the backward
pass at its first bucket, which the autograd engine runs before DDP's ``finalize_backward``; DDP's logging records the
same two instants in the iterations it samples.
"""

# No ``from __future__ import annotations``: keep the module importable on its own for DDP's hook annotations check.
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from lit_accel.utilities._compat import current_graph_task_id, ddp_logging_data, queue_backward_callback

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["DDPLoggingCommStats", "HookCommStats"]

# Intervals kept for pop_elapsed_s; beyond this (nobody popped for thousands of collectives) they are folded into a
# number so that memory stays bounded. An EfficiencyMonitor pops at every logging step, far below it.
_MAX_PENDING = 4096


class _Totals:
    """Pickles (``start_method="spawn"``) as its totals only: locks, CUDA events and DDP models do not travel."""

    calls: int
    bytes: int

    def __getstate__(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._restore(state["calls"], state["bytes"])

    def _restore(self, calls: int, nbytes: int) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(calls={self.calls}, bytes={self.bytes})"


class HookCommStats(_Totals):
    """Host-side counters of the gradient collectives issued through a counting comm hook (``counting_comm_hook``).

    Used when ``AccelDDP(comm_hook=...)`` names a hook or passes a callable (with no hook, AccelDDP uses
    :class:`DDPLoggingCommStats`); satisfies :class:`lit_accel.protocols.CommStats`.

    Attributes:
        calls: all-reduce collectives issued so far (cumulative; a Python ``int``).
        bytes: bytes those collectives put on the wire per rank, after any compression (cumulative; a Python
            ``int``). This is the payload size; a ring all-reduce moves about ``2 (n - 1) / n`` times it per rank
            (Patarasuk & Yuan, 2009).

    Only gradient all-reduces issued by DDP are counted: SyncBatchNorm's statistics and ``broadcast_buffers`` go
    through other collectives.
    """

    def __init__(self) -> None:
        self.calls: int = 0
        self.bytes: int = 0
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

    def pop_elapsed_s(self) -> float:
        """Seconds during which at least one gradient collective was in flight, since the previous call.

        Overlapping collectives (several buckets in flight at once) are counted once: this is the union of their
        intervals, so it never exceeds wall-clock time. On CUDA the interval runs from the moment DDP hands the
        bucket to the hook (an event on the current stream) to the completion of the collective's future, and
        this call waits for those events: call it at logging steps only.
        """
        with self._lock:
            cpu, self._cpu_intervals = self._cpu_intervals, []
            cuda, self._cuda_intervals = self._cuda_intervals, []
            elapsed, self._folded_s = self._folded_s, 0.0
        for start, end in cuda:
            start.synchronize()
            end.synchronize()
        return elapsed + _union_length(cpu) + _union_length(_cuda_spans(cuda))

    def pop_exposed_s(self) -> float:
        """Seconds this rank waited for its gradient collectives after its backward's compute ended, since the last pop.

        Per synchronised backward: from the end of its compute (a callback the first bucket queues on the backward
        pass, which the autograd engine runs after the last backward op and before DDP's ``finalize_backward``) to the
        completion of its last collective, or 0 when every collective finished before the compute did (fully
        hidden). A bucket handed over outside a backward pass counts from its hand-off. Call at logging steps only.
        """
        with self._lock:
            done = [r for r in self._rounds if r is not self._open_round]
            self._rounds = [r for r in self._rounds if r is self._open_round]
            exposed, self._folded_exposed_s = self._folded_exposed_s, 0.0
        return exposed + sum(r.exposed_s() for r in done)

    def _start(self, device: torch.device) -> Any:
        return _mark(device)

    def _round(self, device: torch.device) -> "_Round":
        """The round a bucket handed over now belongs to; the first bucket of a backward pass opens it."""
        task = current_graph_task_id()
        current = self._open_round
        if current is not None and current.task == task >= 0:
            with self._lock:
                current.pending += 1
            return current
        current = _Round(task)  # a new backward (a round left open by one that raised stays without an end)
        current.pending = 1
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

    def _finish(self, start: Any, fut: torch.futures.Future, round_: "_Round | None" = None) -> Any:
        # Runs as the future's ``then`` callback, when the collective has completed (on CUDA: with the current
        # stream synchronised to the collective's, so an event recorded now marks its end on the device).
        end = self._record_end(start)
        if round_ is not None:
            with self._lock:
                round_.ends.append(end)
                round_.pending -= 1
        return fut.value()

    def _record_end(self, start: Any) -> Any:
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

    def _restore(self, calls: int, nbytes: int) -> None:
        self.calls, self.bytes = calls, nbytes


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


class DDPLoggingCommStats(_Totals):
    """Counters of DDP's built-in all-reduce when no comm hook is registered, from DDP's own logging.

    Satisfies :class:`lit_accel.protocols.CommStats`. AccelDDP calls :meth:`add_round` once per synchronised
    backward (the only per-step work: a Python integer increment); everything else is read from
    ``DistributedDataParallel``'s logging data when the counters are read, at logging steps:

    * ``calls`` = the buckets of the first round's layout + (rounds - 1) x the buckets of the current layout. DDP
      reduces every bucket once per round and rebuilds its buckets in gradient-ready order right before the second
      round (not with ``find_unused_parameters=True``), but publishes the rebuilt layout only at its next
      synchronised forward: a read in between counts the rounds after the first with the first layout (the next
      read is exact again, since the number is recomputed from the round count each time).
    * ``bytes`` = rounds x the bytes of all buckets (``numel x element size`` of the gradients DDP reduces).
    * :meth:`pop_elapsed_s`: rounds since the previous call x DDP's per-round communication time of its latest
      *sampled* iteration; an estimate, see the method.

    Counters accumulate over fits: each new DDP model is attached with :meth:`attach`, and :meth:`detach` (at
    teardown) folds its numbers in and drops the reference, so the model's buckets can be freed.
    """

    def __init__(self) -> None:
        self.rounds = 0  # synchronised backward passes, all fits together
        self._ddp: DistributedDataParallel | None = None
        self._first_round = 0  # value of ``rounds`` when the current model was attached
        self._popped_round = 0  # value of ``rounds`` at the previous pop
        self._done_calls = 0  # calls and bytes of the models detached before
        self._done_bytes = 0
        self._folded_s = 0.0  # time of rounds not popped before their model was detached
        self._initial: tuple[int, ...] = ()  # bucket bytes of the construction layout
        self._rebuilt: tuple[int, ...] | None = None  # ... and of the rebuilt one, once DDP published it
        self._exposed_round = 0  # value of ``rounds`` at the previous pop_exposed_s
        self._folded_exposed_s = 0.0

    def attach(self, ddp: "DistributedDataParallel") -> None:
        """Start counting for a newly wrapped model (reads its construction-time bucket layout once)."""
        self.detach()
        self._ddp = ddp
        self._first_round = self.rounds
        self._initial = _bucket_sizes(ddp_logging_data(ddp).get("bucket_sizes"))
        self._rebuilt = None

    def detach(self) -> None:
        """Fold the current model's numbers into the totals and drop the reference to it."""
        if self._ddp is None:
            return
        self._done_calls, self._done_bytes = self.calls, self.bytes
        comm_s, exposed_s = self._round_times_s()
        self._folded_s += (self.rounds - self._popped_round) * comm_s
        self._folded_exposed_s += (self.rounds - self._exposed_round) * exposed_s
        self._popped_round = self._exposed_round = self._first_round = self.rounds
        self._ddp = None

    def add_round(self) -> None:
        """One synchronised backward: DDP all-reduces every bucket once."""
        self.rounds += 1

    @property
    def calls(self) -> int:
        """All-reduce collectives issued so far (cumulative), one per bucket per round."""
        rounds = self.rounds - self._first_round
        if self._ddp is None or rounds == 0:
            return self._done_calls
        current = self._layout()
        return self._done_calls + len(self._initial) + (rounds - 1) * len(current)

    @property
    def bytes(self) -> int:
        """Bytes those collectives put on the wire per rank (cumulative): rounds x the gradient bytes DDP reduces."""
        if self._ddp is None:
            return self._done_bytes
        return self._done_bytes + (self.rounds - self._first_round) * sum(self._initial)

    def pop_elapsed_s(self) -> float:
        """Estimated seconds with a gradient all-reduce in flight since the previous call (sampled, not measured).

        Rounds since the previous call x ``backward_comm_time`` of DDP's latest sampled iteration: the time from
        the launch of its first bucket's all-reduce to the end of ``finalize_backward`` (all buckets reduced, waiting
        on slower peers included), measured by DDP's reducer with the host clock on CPU and CUDA events on GPU. It is
        not measured over this window: DDP samples synchronised iterations 1-10 and then every ``sample_rate``-th
        (AccelDDP sets 1 on CPU and the Trainer's ``log_every_n_steps`` on CUDA, where a sample costs a wait), and
        publishes a sample at the next synchronised forward: on CPU the time is that of the round before the latest,
        on CUDA of a round up to one logging interval earlier. ``0.0`` until DDP's first sample (published at the
        second synchronised forward).
        """
        rounds, self._popped_round = self.rounds - self._popped_round, self.rounds
        elapsed, self._folded_s = self._folded_s, 0.0
        if rounds and self._ddp is not None:
            elapsed += rounds * self._round_times_s()[0]
        return elapsed

    def pop_exposed_s(self) -> float:
        """Estimated seconds this rank waited for its all-reduces after the backward's compute, since the last call.

        Rounds since the previous call x (``backward_comm_time`` - ``backward_compute_comm_overlap_time``) of DDP's
        latest sampled iteration: the reducer's end of ``finalize_backward`` (all buckets reduced) minus the end of
        the backward's compute (recorded when the autograd engine runs DDP's finalize callback), on the same clocks
        and with the same sampling as :meth:`pop_elapsed_s`. ``0.0`` until DDP's first sample.
        """
        rounds, self._exposed_round = self.rounds - self._exposed_round, self.rounds
        exposed, self._folded_exposed_s = self._folded_exposed_s, 0.0
        if rounds and self._ddp is not None:
            exposed += rounds * self._round_times_s()[1]
        return exposed

    def _layout(self) -> tuple[int, ...]:
        if self._rebuilt is None and self._ddp is not None:
            rebuilt = ddp_logging_data(self._ddp).get("rebuilt_bucket_sizes")
            if rebuilt:
                self._rebuilt = _bucket_sizes(rebuilt)  # DDP rebuilds once: cache it, stop reading
        return self._initial if self._rebuilt is None else self._rebuilt

    def _round_times_s(self) -> tuple[float, float]:
        """(communication, exposed) seconds of DDP's latest sampled round."""
        if self._ddp is None:
            return 0.0, 0.0
        data = ddp_logging_data(self._ddp)
        # The latest sample; its running means when that sample recorded no time (a sampled iteration without the
        # backward's events, e.g. one whose backward never ran).
        latest = bool(data.get("backward_comm_time"))
        prefix = "" if latest else "avg_"
        comm = int(data.get(f"{prefix}backward_comm_time") or 0)
        # Measured from the first bucket's launch to the end of the compute; absent when the compute ended first.
        overlap = int(data.get(f"{prefix}backward_compute_comm_overlap_time") or 0)
        return comm / 1e9, max(0, comm - overlap) / 1e9

    def _restore(self, calls: int, nbytes: int) -> None:
        self._done_calls, self._done_bytes = calls, nbytes


def _mark(device: torch.device) -> Any:
    """Now, on the host clock, or as a CUDA event recorded on the current stream."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _bucket_sizes(text: object) -> tuple[int, ...]:
    """DDP's ``"a, b, c"`` bucket sizes (bytes) as integers."""
    if not isinstance(text, str) or not text.strip():
        return ()
    return tuple(int(part) for part in text.split(","))


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
