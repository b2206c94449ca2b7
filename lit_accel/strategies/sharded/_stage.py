"""``TimedStage``: torch's ``PipelineStage`` with its compute actions timed and its sends counted.

The bubble meter learns when the stage computes (forward, full backward, input and weight halves); the comm stats
learn every activation and gradient a stage sends to its neighbour (``P2POp`` tensors, counted before they are
posted, so nothing waits). Both through the stage's public methods, which every torch schedule calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.pipelining import PipelineStage

from lit_accel.protocols import PipelineBubble
from lit_accel.strategies.sharded._fsdp_comm import FSDPCommStats

if TYPE_CHECKING:
    from lit_accel.meters.pipeline_bubble import BubbleMeter

__all__ = ["ParallelCommStats", "TimedStage"]


class ParallelCommStats(FSDPCommStats):
    """FSDP's all-gathers and reduce-scatters over the data dimension plus the pipeline's point-to-point sends.

    ``calls``/``bytes`` count all of them; ``p2p_sends``/``p2p_bytes`` the sends alone. ``bus_bytes`` is the ring
    traffic of the FSDP collectives over the ``data`` ranks plus every sent byte (a send crosses one link once).
    Also :class:`~lit_accel.protocols.PipelineBubbleStats`, for the ``EfficiencyMonitor``.
    """

    def __init__(self, data: int = 1) -> None:
        super().__init__()
        self.data = data
        self.p2p_sends = self.p2p_bytes = 0
        #: The pipeline's bubble meter, once the strategy built one (``None``: no pipeline dimension).
        self.bubble: BubbleMeter | None = None

    @property
    def pipelined(self) -> bool:
        """Whether a pipeline schedule runs the steps."""
        return self.bubble is not None

    def pop_pipeline_bubble(self) -> PipelineBubble | None:
        """This rank's pipeline busy, wall and analytic idle seconds since the last call (logging steps only)."""
        return None if self.bubble is None else self.bubble.pop()

    def count_sends(self, ops: list[Any]) -> None:
        """Count the tensors of a list of ``P2POp`` sends."""
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        with self._lock:
            self.p2p_sends += len(ops)
            self.p2p_bytes += nbytes
            self.calls += len(ops)
            self.bytes += nbytes

    def bus_bytes(self, world_size: int) -> float:
        """Ring bytes of the FSDP collectives (over ``data`` ranks, not the world) plus the sent bytes."""
        n = self.data
        return (self.bytes - self.p2p_bytes) * (n - 1) / n + self.p2p_bytes


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that reports its compute actions to ``meter`` and its sends to ``comm``."""

    def __init__(self, *args: Any, meter: BubbleMeter, comm: ParallelCommStats, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter, self.comm = meter, comm

    def _timed(self, kind: str, run: Any, *args: Any, **kwargs: Any) -> Any:
        self.meter.action_start(kind)
        try:
            return run(*args, **kwargs)
        finally:
            self.meter.action_end(kind)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:  # fmt: skip
        kind = "B" if full_backward else "I"
        return self._timed(kind, super().backward_one_chunk, bwd_chunk_id, loss=loss, full_backward=full_backward,
                           last_backward=last_backward)  # fmt: skip

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("W", super().backward_weight_one_chunk, *args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.comm.count_sends(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.comm.count_sends(ops)
        return ops
