"""Counters of FSDP2's collectives: every all-gather and reduce-scatter, through FSDP's own custom-comm hooks.

``FSDPModule.set_custom_all_gather``/``set_custom_reduce_scatter`` take objects that FSDP calls instead of its default
collectives; lit_accel's forward to the same ``torch.distributed`` calls FSDP would make and add a few Python integer
operations, so the counts are exact and cost no host sync. Bytes are the unsharded buffer sizes (the collectives'
payload in the nccl-tests sense); a ring all-gather or reduce-scatter moves ``(n - 1) / n`` of that per device, so an
FSDP step moves about ``3K(n - 1)/n`` bytes (two all-gathers and one reduce-scatter of the K parameter bytes) where DDP
moves ``2K(n - 1)/n``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lit_accel.strategies._comm_stats import HookCommStats
from lit_accel.utilities._compat import fsdp_comm_base_classes

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FSDPCommStats", "install_counting_comms"]

_AllGather, _ReduceScatter = fsdp_comm_base_classes()


class FSDPCommStats(HookCommStats):
    """All-gathers and reduce-scatters of an FSDP2 model; satisfies :class:`lit_accel.protocols.CommStats`.

    ``calls``/``bytes`` count both kinds; ``all_gathers``/``reduce_scatters`` and their bytes count each, and
    ``rounds`` the synchronised backward passes (reduce-scatter rounds: one per optimizer step with accumulation).
    """

    def __init__(self) -> None:
        super().__init__()
        self.all_gathers = self.reduce_scatters = self.rounds = 0
        self.all_gather_bytes = self.reduce_scatter_bytes = 0

    def bus_bytes(self, world_size: int) -> float:
        """Bytes per device the ring algorithms move for the counted collectives: (n - 1) / n of each payload."""
        return self.bytes * (world_size - 1) / world_size

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        if kind == "all_gather":
            self.all_gathers += 1
            self.all_gather_bytes += nbytes
        else:
            self.reduce_scatters += 1
            self.reduce_scatter_bytes += nbytes

    def _timed(self, work: Any, start: Any) -> Any:
        if work is None:  # synchronous: done now
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            self._finish(start, done)
        else:
            work.get_future().then(lambda fut: self._finish(start, fut))
        return work

    def _restore(self, calls: int, nbytes: int) -> None:
        self.calls, self.bytes = calls, nbytes


def _allocate(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class _CountingAllGather(_AllGather):  # type: ignore[misc, valid-type]
    def __init__(self, stats: FSDPCommStats) -> None:
        self.stats = stats

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self.stats._count("all_gather", output_tensor.numel() * output_tensor.element_size())
        start = self.stats._start(output_tensor.device)
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return self.stats._timed(work, start)


class _CountingReduceScatter(_ReduceScatter):  # type: ignore[misc, valid-type]
    def __init__(self, stats: FSDPCommStats) -> None:
        self.stats = stats

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ):
        self.stats._count("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        start = self.stats._start(input_tensor.device)
        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        return self.stats._timed(work, start)


def install_counting_comms(model: nn.Module, stats: FSDPCommStats) -> int:
    """Route every FSDP module's collectives of ``model`` through counting ones; returns how many modules."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = _CountingAllGather(stats), _CountingReduceScatter(stats)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return len(modules)
