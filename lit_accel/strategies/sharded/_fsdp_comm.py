"""FSDP2's collectives: every all-gather and reduce-scatter counted (FSDP's custom-comm hooks); the reduction switched.

``FSDPModule.set_custom_all_gather``/``set_custom_reduce_scatter`` take objects that FSDP calls instead of its default
collectives; lit_accel's forward to the same ``torch.distributed`` calls FSDP would make and add a few Python integer
operations, so the counts are exact and cost no host sync. Bytes are the unsharded buffer sizes (the collectives'
payload in the nccl-tests sense); a ring all-gather or reduce-scatter moves ``(n - 1) / n`` of that per device, so an
FSDP step moves about ``3K(n - 1)/n`` bytes (two all-gathers and one reduce-scatter of the K parameter bytes) where DDP
moves ``2K(n - 1)/n``.

Exposed communication (``pop_exposed_s``): off CUDA, FSDP2 issues every collective synchronously on the training
thread, so the time inside those calls is exactly what overlap did not hide. On CUDA the collectives run on FSDP's
own streams: the exposed part is the compute stream's wait for the parameters in each pre-forward (two events around
FSDP's pre-forward hook) plus each backward's last reduce-scatter, which nothing is left to overlap with.

``GradientSync`` switches the gradient reduction of a strategy's outermost FSDP modules off for the non-final backward
passes of an accumulation window (Lightning's ``block_backward_sync``) and on for one inside it (micro-batching).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lit_accel.strategies.parts._comm_stats import HookCommStats
from lit_accel.utilities._compat import fsdp_comm_base_classes
from lit_accel.utilities._timing import IntervalTimer
from lit_accel.utilities._torch_fallbacks import all_gather_single, reduce_scatter_single

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FSDPCommStats", "GradientSync", "gathered_attempts", "install_counting_comms"]

_AllGather, _ReduceScatter = fsdp_comm_base_classes()
_MAX_ROUNDS = 4096  # rounds kept for pop_exposed_s before the completed ones are folded into a number


class FSDPCommStats(HookCommStats):
    """All-gathers and reduce-scatters of an FSDP2 model; satisfies :class:`lit_accel.protocols.CommStats`.

    ``calls``/``bytes`` count both kinds; ``all_gathers``/``reduce_scatters`` count each, and
    ``rounds`` the synchronised backward passes (reduce-scatter rounds: one per optimizer step with accumulation;
    under ``micro_batch_size="auto"`` one per loaded batch, and a discarded attempt's where it ran).
    """

    def __init__(self) -> None:
        super().__init__()
        self.all_gathers = self.reduce_scatters = self.rounds = 0
        self._blocked_s = 0.0  # off CUDA: host time inside synchronous collectives
        self._waits: IntervalTimer | None = None  # on CUDA: the compute stream in FSDP's pre-forward hooks
        self._last_reduce_scatter: dict[int, tuple[Any, Any]] = {}  # on CUDA: round -> its last (start, end) events

    def pop_exposed_s(self) -> float:
        """Seconds the training waited for FSDP's collectives since the last pop (module docstring); logging steps."""
        with self._lock:
            blocked, self._blocked_s = self._blocked_s, 0.0
            tails, self._last_reduce_scatter = self._last_reduce_scatter, {}
        for _, end in tails.values():
            end.synchronize()
        waits = self._waits.pop_total_s() if self._waits is not None else 0.0
        return blocked + waits + sum(start.elapsed_time(end) / 1e3 for start, end in tails.values())

    def watch_parameter_waits(self, modules: list[Any], device: torch.device) -> None:
        """On CUDA: time the compute stream through each FSDP module's pre-forward (it waits for its all-gather)."""
        if device.type != "cuda":
            return
        self._waits = waits = IntervalTimer(device, time.perf_counter)
        for module in modules:
            # FSDP's own pre-forward hook was registered first: ours go right before it and right after it.
            module.register_forward_pre_hook(lambda *_: waits.start(), prepend=True)
            module.register_forward_pre_hook(lambda *_: waits.stop())

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        if kind == "all_gather":
            self.all_gathers += 1
        else:
            self.reduce_scatters += 1

    def _timed(self, work: Any, start: Any, kind: str) -> Any:
        round_ = self.rounds  # the strategy counts the backward after it returns: this is its index

        def finished(end: Any) -> None:
            with self._lock:
                if isinstance(start, float) and work is None:  # the training thread waited in the call
                    self._blocked_s += end - start
                elif not isinstance(start, float) and kind == "reduce_scatter":
                    self._last_reduce_scatter[round_] = (start, end)
                    if len(self._last_reduce_scatter) > _MAX_ROUNDS:  # nobody pops: fold the completed ones
                        done = {r: pair for r, pair in self._last_reduce_scatter.items() if pair[1].query()}
                        self._blocked_s += sum(a.elapsed_time(b) / 1e3 for a, b in done.values())
                        self._last_reduce_scatter = {
                            r: p for r, p in self._last_reduce_scatter.items() if r not in done
                        }

        if work is None:  # synchronous (on CUDA: enqueued on FSDP's stream, which an event now marks)
            finished(self.record_end(start))
        else:
            work.get_future().then(lambda fut: (finished(self.record_end(start)), fut.value())[1])
        return work


class _Counting:
    """FSDP's default allocation, the counters kept (the base of both counting collectives)."""

    def __init__(self, stats: FSDPCommStats) -> None:
        self.stats = stats

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _CountingAllGather(_Counting, _AllGather):  # type: ignore[misc, valid-type]
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self.stats._count("all_gather", output_tensor.numel() * output_tensor.element_size())
        start = self.stats.start(output_tensor.device)
        work = all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return self.stats._timed(work, start, "all_gather")


class _CountingReduceScatter(_Counting, _ReduceScatter):  # type: ignore[misc, valid-type]
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ):
        self.stats._count("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        start = self.stats.start(input_tensor.device)
        work = reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        return self.stats._timed(work, start, "reduce_scatter")


def install_counting_comms(model: nn.Module, stats: FSDPCommStats) -> int:
    """Route every FSDP module's collectives of ``model`` through counting ones; how many modules."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = _CountingAllGather(stats), _CountingReduceScatter(stats)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    parameter = next(model.parameters(), None)
    if parameter is not None:
        stats.watch_parameter_waits(modules, parameter.device)
    return len(modules)


class GradientSync:
    """Whether the backward reduces gradients over FSDP ``roots`` (its only writer); switched for a block."""

    def __init__(self) -> None:
        #: The outermost FSDP modules, whose ``set_requires_gradient_sync`` covers the modules inside them.
        self.roots: list[Any] = []
        #: Whether a backward now keeps its gradients local (inside a switched-off block).
        self.blocked = False

    @contextmanager
    def switched(self, on: bool) -> Generator[None, None, None]:
        """The reduction on or off inside, as it was after (nested: already as asked, left alone)."""
        if self.blocked != on or not self.roots:
            yield
            return
        for module in self.roots:
            module.set_requires_gradient_sync(on)
        self.blocked = not on
        try:
            yield
        finally:
            self.blocked = on
            for module in self.roots:
                module.set_requires_gradient_sync(not on)


def gathered_attempts(
    modules: list[torch.nn.Module], sync: GradientSync, reshard_after_forward: bool
) -> AbstractContextManager[Callable[[], None]] | None:
    """``"auto"``'s attempts without collectives, or None where the roots cannot recover a cut one (torch < 2.14).

    ``modules`` (those ``fully_shard`` was applied to, in that order) stay gathered and no gradient is reduced inside.
    """
    roots = sync.roots
    if not roots or not modules or not all(callable(getattr(root, "reset_iter_state", None)) for root in roots):
        return None
    return _gathered(modules, roots, reshard_after_forward, sync)


@contextmanager
def _gathered(
    modules: list[torch.nn.Module], roots: list[Any], reshard_after_forward: bool, sync: GradientSync
) -> Generator[Callable[[], None], None, None]:
    """Every FSDP module's parameters gathered and kept so, gradients unreduced; resharded and restored after."""

    def gather() -> None:
        for root in roots:
            root.reset_iter_state()  # an attempt cut short leaves FSDP mid-iteration: its documented recovery
        for module in modules:
            module.unshard()  # (the same all-gathers on every rank, in the order of ``modules``)

    gather()
    for root in roots:
        root.set_reshard_after_forward(False)
        root.set_reshard_after_backward(False)
    try:
        with sync.switched(False):
            yield gather
    finally:
        for root in roots:
            root.set_reshard_after_forward(reshard_after_forward)
            root.set_reshard_after_backward(True)
            root.reset_iter_state()  # resharded, and no accumulated gradient left behind
