"""DDP communication hooks by name, and the counters of the gradient all-reduces that the ``EfficiencyMonitor`` reads.

:class:`~lit_accel.strategies.accel_ddp.AccelDDP` keeps one of two kinds of counters in ``strategy.comm_stats``, both
satisfying :class:`SupportsCommStats` (``calls``, ``bytes``, ``pop_elapsed_s()``):

* **No hook (the default, ``comm_hook=None``)**: DDP runs its built-in C++ all-reduce, exactly as under Lightning's
  ``DDPStrategy``, and :class:`DDPLoggingCommStats` derives the numbers from DDP's own logging: AccelDDP counts
  all-reduce *rounds* (synchronised backward passes) with one Python integer increment each; the bucket layout
  (for ``calls`` and ``bytes``) and DDP's sampled per-round communication time are read only when the counters are
  read, at logging steps. A Python comm hook would cost about 1 ms per step on a CPU ViT (the bucket division moves
  from C++ to Python: ``benchmarks/RESULTS.md``, section 1), which is why none is registered unless asked for.
* **A hook (``comm_hook=`` a name or a callable)**: AccelDDP registers it through :func:`counting_comm_hook`, which
  counts and times every bucket it reduces in :class:`CommStats`: counting costs no device synchronisation, and
  timing is resolved only in :meth:`CommStats.pop_elapsed_s`.

What is counted, per gradient bucket (``calls`` / ``bytes`` on the wire per rank, before the all-reduce algorithm):

* no hook, or torch's ``allreduce_hook``: 1 collective, ``numel x element size`` of the bucket;
* ``"fp16"`` / ``"bf16"``: 1 collective, ``numel x 2`` (the bucket cast to 16 bits);
* ``"powersgd"``: before ``start_powerSGD_iter`` as the default; then 3 collectives (the uncompressed tensors, P and
  Q), with the element count torch's ``PowerSGDState`` itself adds to ``total_numel_after_compression`` for the
  bucket;
* a callable: assumed 1 collective of the bucket's uncompressed size (the wrapper cannot see inside it).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations with the real
# ``dist.GradBucket`` and ``Future[Tensor]`` types and refuses strings.
import inspect
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from lit_accel.utilities._compat import ddp_logging_data
from lit_accel.utilities._validation import check_int

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "COMM_HOOK_NAMES",
    "CommHookName",
    "CommStats",
    "DDPLoggingCommStats",
    "SupportsCommStats",
    "counting_comm_hook",
    "resolve_comm_hook",
    "validate_comm_hook",
]

CommHookName = Literal["fp16", "bf16", "powersgd"]
COMM_HOOK_NAMES: tuple[str, ...] = ("fp16", "bf16", "powersgd")

_HookKind = Literal["allreduce", "fp16", "bf16", "powersgd", "custom"]
# Intervals kept for pop_elapsed_s; beyond this (nobody popped for thousands of collectives) they are folded into a
# number so that memory stays bounded. An EfficiencyMonitor pops at every logging step, far below it.
_MAX_PENDING = 4096
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


@runtime_checkable
class SupportsCommStats(Protocol):
    """What ``strategy.comm_stats`` offers its readers (the ``EfficiencyMonitor``), whichever counters fill it.

    ``calls`` and ``bytes`` are cumulative Python ``int`` values over the strategy's life (all fits); read them and
    call :meth:`pop_elapsed_s` at logging steps only (they may resolve device events or read DDP's logging data).
    """

    @property
    def calls(self) -> int:
        """Gradient all-reduce collectives issued so far."""
        ...

    @property
    def bytes(self) -> int:
        """Bytes those collectives put on the wire per rank (the payload, after any compression)."""
        ...

    def pop_elapsed_s(self) -> float:
        """Seconds with a gradient collective in flight since the previous call (see each implementation)."""
        ...


class CommStats:
    """Host-side counters of the gradient collectives issued by DDP through AccelDDP's comm hook.

    Used when ``AccelDDP(comm_hook=...)`` names a hook or passes a callable (with no hook, AccelDDP uses
    :class:`DDPLoggingCommStats`); satisfies :class:`SupportsCommStats`.

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

    def _start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _finish(self, start: Any, fut: torch.futures.Future) -> Any:
        # Runs as the future's ``then`` callback, when the collective has completed (on CUDA: with the current
        # stream synchronised to the collective's, so an event recorded now marks its end on the device).
        if isinstance(start, float):
            interval = (start, time.perf_counter())
            with self._lock:
                self._cpu_intervals.append(interval)
                if len(self._cpu_intervals) > _MAX_PENDING:
                    self._folded_s += _union_length(self._cpu_intervals)
                    self._cpu_intervals = []
        else:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
            with self._lock:
                self._cuda_intervals.append((start, end_event))
                if len(self._cuda_intervals) > _MAX_PENDING:
                    self._fold_finished_cuda()
        return fut.value()

    def _fold_finished_cuda(self) -> None:
        # Nobody popped for a long time: fold the collectives whose events have completed (``query`` does not
        # block) into a number, so the pending list stays bounded without a host sync on the training path.
        finished = [(s, e) for s, e in self._cuda_intervals if s.query() and e.query()]
        if finished:
            done = {id(e) for _, e in finished}
            self._folded_s += _union_length(_cuda_spans(finished))
            self._cuda_intervals = [(s, e) for s, e in self._cuda_intervals if id(e) not in done]

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for start_method="spawn" (the Trainer and its strategy are pickled): the counters travel, the
        # lock and the timing intervals (CUDA events cannot be pickled) do not.
        return {"calls": self.calls, "bytes": self.bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.calls, self.bytes = state["calls"], state["bytes"]

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, bytes={self.bytes})"


class DDPLoggingCommStats:
    """Counters of DDP's built-in all-reduce when no comm hook is registered, from DDP's own logging.

    Satisfies :class:`SupportsCommStats`. AccelDDP calls :meth:`add_round` once per synchronised backward (the only
    per-step work: a Python integer increment); everything else is read from ``DistributedDataParallel``'s logging
    data when the counters are read, at logging steps:

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
        self._folded_s += (self.rounds - self._popped_round) * self._round_time_s()
        self._popped_round = self._first_round = self.rounds
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
            elapsed += rounds * self._round_time_s()
        return elapsed

    def _layout(self) -> tuple[int, ...]:
        if self._rebuilt is None and self._ddp is not None:
            rebuilt = ddp_logging_data(self._ddp).get("rebuilt_bucket_sizes")
            if rebuilt:
                self._rebuilt = _bucket_sizes(rebuilt)  # DDP rebuilds once: cache it, stop reading
        return self._initial if self._rebuilt is None else self._rebuilt

    def _round_time_s(self) -> float:
        if self._ddp is None:
            return 0.0
        data = ddp_logging_data(self._ddp)
        # The latest sample; its running mean when that sample recorded no time (a sampled iteration without the
        # backward's events, e.g. one whose backward never ran).
        nanoseconds = data.get("backward_comm_time") or data.get("avg_backward_comm_time") or 0
        return int(nanoseconds) / 1e9

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for start_method="spawn": the totals travel, the DDP model does not.
        return {"calls": self.calls, "bytes": self.bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._done_calls, self._done_bytes = state["calls"], state["bytes"]

    def __repr__(self) -> str:
        return f"DDPLoggingCommStats(rounds={self.rounds}, calls={self.calls}, bytes={self.bytes})"


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


def validate_comm_hook(
    comm_hook: object, comm_state: object, powersgd_rank: int | None, powersgd_start_iter: int | None
) -> None:
    """Check AccelDDP's comm-hook arguments at construction; raise naming the value, what is allowed and the fix."""
    if isinstance(comm_hook, str):
        if comm_hook not in COMM_HOOK_NAMES:
            raise ValueError(
                f"AccelDDP(comm_hook={comm_hook!r}): expected one of {', '.join(map(repr, COMM_HOOK_NAMES))}, a"
                " callable hook(state, bucket) -> Future[Tensor], or None (the plain all-reduce mean). Fix: pass e.g."
                " comm_hook='bf16' to compress gradients to 16 bits, or drop comm_hook."
            )
    elif comm_hook is not None:
        if not callable(comm_hook):
            raise TypeError(
                f"AccelDDP(comm_hook={comm_hook!r}): expected None, one of {COMM_HOOK_NAMES} or a callable"
                " hook(state, bucket) -> torch.futures.Future[torch.Tensor]."
            )
        try:
            inspect.signature(comm_hook).bind(None, None)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"AccelDDP(comm_hook={comm_hook!r}) cannot be called as hook(state, bucket): {err}. Fix: give it"
                " the signature of torch's ddp_comm_hooks, e.g. default_hooks.allreduce_hook."
            ) from err
    if comm_hook != "powersgd" and (powersgd_rank is not None or powersgd_start_iter is not None):
        raise ValueError(
            f"AccelDDP(powersgd_rank={powersgd_rank!r}, powersgd_start_iter={powersgd_start_iter!r}) only apply"
            f" to comm_hook='powersgd', got comm_hook={comm_hook!r}. Fix: pass comm_hook='powersgd' or drop them."
        )
    if comm_hook == "powersgd":
        if comm_state is not None:
            if not isinstance(comm_state, powerSGD_hook.PowerSGDState):
                raise TypeError(
                    f"AccelDDP(comm_hook='powersgd', comm_state={comm_state!r}): expected a PowerSGDState or None."
                )
            if powersgd_rank is not None or powersgd_start_iter is not None:
                raise ValueError(
                    "AccelDDP(comm_hook='powersgd'): pass either comm_state=PowerSGDState(...) or powersgd_rank/"
                    "powersgd_start_iter, not both. Fix: set the rank and start iteration in your PowerSGDState."
                )
        check_int("AccelDDP", "powersgd_rank", powersgd_rank, allow_none=True)
        # PowerSGD's error feedback and warm start need two plain all-reduce steps first (DDP rebuilds its
        # buckets after the first iteration; torch raises for start_powerSGD_iter <= 1).
        check_int("AccelDDP", "powersgd_start_iter", powersgd_start_iter, minimum=2, allow_none=True, example=1000)
    elif comm_state is not None and not callable(comm_hook):
        raise ValueError(
            f"AccelDDP(comm_state={comm_state!r}) is only used with comm_hook='powersgd' or a callable hook, got"
            f" comm_hook={comm_hook!r}. Fix: drop comm_state."
        )
    if isinstance(comm_state, post_localSGD_hook.PostLocalSGDState):
        raise ValueError(
            "AccelDDP does not support post-local SGD (comm_state=PostLocalSGDState): it needs periodic model"
            " averaging. Fix: use Lightning's DDPStrategy(ddp_comm_state=..., model_averaging_period=...)."
        )


def resolve_comm_hook(
    comm_hook: str | CommHook | None,
    comm_state: object | None,
    powersgd_rank: int,
    powersgd_start_iter: int,
    process_group: dist.ProcessGroup | None,
) -> tuple[CommHook, object | None, _HookKind]:
    """Turn AccelDDP's ``comm_hook`` argument into ``(hook, state, kind)`` for :func:`counting_comm_hook`.

    Arguments are validated by AccelDDP's constructor; this only maps them. ``process_group`` is the DDP module's
    (the default group unless the user passed one): torch's built-in hooks take it as their state, and a PowerSGD
    state is created for it here, once the group exists.
    """
    if comm_hook is None:
        return default_hooks.allreduce_hook, process_group, "allreduce"
    if comm_hook == "fp16":
        return default_hooks.fp16_compress_hook, process_group, "fp16"
    if comm_hook == "bf16":
        return default_hooks.bf16_compress_hook, process_group, "bf16"
    if comm_hook == "powersgd":
        state = comm_state
        if state is None:
            state = powerSGD_hook.PowerSGDState(
                process_group=process_group,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=powersgd_start_iter,
            )
        return powerSGD_hook.powerSGD_hook, state, "powersgd"
    assert callable(comm_hook)
    # torch's hooks take a process group as their state, None meaning the whole world: default to DDP's own group,
    # so that a hook such as default_hooks.allreduce_hook reduces over the group DDP was given.
    return comm_hook, comm_state if comm_state is not None else process_group, "custom"


def counting_comm_hook(hook: CommHook, kind: _HookKind, stats: CommStats) -> CommHook:
    """Wrap a DDP comm hook so that every bucket it reduces is counted and timed in ``stats``.

    The wrapper adds a few Python integer operations and one ``Future.then`` per bucket; it never reads a device
    value. See the module docstring for what is counted per hook.
    """

    def accel_counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        numel = buffer.numel()
        compressing = False
        numel_before = 0
        if kind == "powersgd":
            compressing = state.iter >= state.start_powerSGD_iter  # type: ignore[attr-defined]
            numel_before = state.total_numel_after_compression  # type: ignore[attr-defined]
        start = stats._start(buffer.device)
        fut = hook(state, bucket)
        if kind in ("fp16", "bf16"):
            calls, nbytes = 1, numel * 2
        elif compressing:
            # PowerSGD all-reduces the tensors it does not compress, then P, then Q (three collectives, issued
            # even when a list is empty); the state adds exactly their element counts while building them.
            calls = 3
            nbytes = (state.total_numel_after_compression - numel_before) * buffer.element_size()  # type: ignore[attr-defined]
        else:
            calls, nbytes = 1, numel * buffer.element_size()
        stats.calls += calls
        stats.bytes += nbytes
        return fut.then(lambda f: stats._finish(start, f))

    accel_counting_hook.__qualname__ = f"accel_counting_hook({getattr(hook, '__qualname__', repr(hook))})"
    return accel_counting_hook
