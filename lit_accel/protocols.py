"""The contracts between lit_accel's parts: what the monitors and schedulers read from a strategy or precision plugin.

The callbacks depend on these protocols only, never on lit_accel's classes, so a strategy or precision plugin of your
own feeds them by implementing the methods below (``docs/extending.md`` shows a minimal one). Every value handed over
is read without a host-device synchronisation unless its docstring says otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = [
    "BusBytes",
    "CommStats",
    "CommStatsProvider",
    "CommTiming",
    "ExposedComm",
    "PipelineBubble",
    "PipelineBubbleStats",
    "PipelineStages",
    "ScalerStats",
    "ScalerStatsProvider",
    "SkippedStepRecord",
    "StagePlacement",
]


class ScalerStats(NamedTuple):
    """0-d device tensors describing a loss scaler after its last update; reading them needs no host sync.

    ``scale`` is float32, the rest int64 and cumulative. Stack them and call ``.tolist()`` once, at logging steps.
    """

    scale: Tensor
    growth_tracker: Tensor
    overflow_streak: Tensor
    skipped_steps: Tensor
    growths: Tensor
    backoffs: Tensor


@runtime_checkable
class ScalerStatsProvider(Protocol):
    """A loss scaler (``DynamicGradScaler``), or a precision plugin, whose counters the ``LossScaleMonitor`` reads.

    The monitor asks the precision plugin first, then its ``scaler``; a plain ``torch.amp.GradScaler`` gets counters
    derived from its scale. ``loss_scaling`` says whether the loss is scaled at all (``False``: nothing to log).
    """

    @property
    def loss_scaling(self) -> bool:
        """Whether this plugin scales the loss (fp16)."""
        ...

    def scaler_stats(self) -> ScalerStats:
        """The scaler's current state as device tensors (no host sync)."""
        ...


@runtime_checkable
class SkippedStepRecord(Protocol):
    """The one record of whether each optimizer's last step was skipped.

    Kept by whichever part skips steps in a fit: ``AccelPrecision`` (fp16 overflows) or the ``NonFiniteGuard`` callback
    (inf/NaN gradients under bf16/fp32). The step-interval LR schedulers it makes skip-aware ask it after every
    optimizer step, so the answer must be a host bool (the owner decides when it is worth a sync: a flag only the
    device knows is read when asked).
    """

    def step_was_skipped(self, optimizer: Optimizer | None = None) -> bool:
        """Whether the last step of ``optimizer`` (of any optimizer, for ``None``) was skipped."""
        ...


@runtime_checkable
class CommStats(Protocol):
    """Counters of a strategy's gradient collectives, cumulative over its life.

    ``calls`` and ``bytes`` are Python ints: collectives issued and the payload bytes they carried per rank (after
    any compression; a ring all-reduce moves about ``2 (n - 1) / n`` times its payload per rank). Read them and call
    :meth:`pop_elapsed_s` at logging steps only: they may resolve device events.
    """

    @property
    def calls(self) -> int:
        """Gradient collectives issued so far."""
        ...

    @property
    def bytes(self) -> int:
        """Payload bytes those collectives carried per rank."""
        ...

    def pop_elapsed_s(self) -> float:
        """Seconds with a gradient collective in flight since the previous call."""
        ...


@runtime_checkable
class BusBytes(Protocol):
    """Optional, on a ``CommStats`` whose collectives are not all all-reduces (FSDP's all-gathers, reduce-scatters).

    Without it the ``EfficiencyMonitor`` takes every collective for an all-reduce (ring traffic ``2 (n - 1) / n``).
    """

    def bus_bytes(self, world_size: int) -> float:
        """Bytes per rank the ring algorithms move for the collectives counted so far (nccl-tests' busbw)."""
        ...


@runtime_checkable
class ExposedComm(Protocol):
    """Optional, on a ``CommStats``: how long this rank waited for its gradient collectives (what overlap did not hide).

    Without it the ``EfficiencyMonitor`` logs no ``comm_exposed_frac``/``compute_frac``, and its straggler attribution
    leaves the backward (which holds the wait) out of a rank's own time.
    """

    def pop_exposed_s(self) -> float:
        """Seconds this rank waited for gradient collectives after its local compute was done, since the previous call.

        Called at logging steps only (it may resolve device events): the time from the end of the backward's compute
        to the completion of its last collective (and, for sharded strategies, waits for parameter all-gathers).
        """
        ...


@runtime_checkable
class CommTiming(Protocol):
    """Optional, on a ``CommStats`` that times its collectives exactly only when asked (it costs host time).

    A consumer that wants exact :meth:`CommStats.pop_elapsed_s` (and ``pop_exposed_s``) calls :meth:`request_timing`
    before the fit's first backward, e.g. in its ``on_train_start`` (``EfficiencyMonitor(exact_comm_timing=True)``
    does). Without a request the pops may return an estimate (AccelDDP: from DDP's sampled rounds) or 0.0; ``calls``
    and ``bytes`` are counted either way.
    """

    def request_timing(self) -> None:
        """Time the collectives of this fit from its first backward on."""
        ...


@runtime_checkable
class CommStatsProvider(Protocol):
    """A strategy that counts its gradient communication for the ``EfficiencyMonitor``."""

    @property
    def comm_stats(self) -> CommStats:
        """The strategy's counters."""
        ...


class PipelineBubble(NamedTuple):
    """One rank's time in a pipeline schedule over a logging window, in seconds (host numbers).

    ``busy_s``: inside the stage's compute actions; ``wall_s``: inside the schedule's steps; ``analytic_idle_s``: the
    idle time the schedule itself implies for this rank with the same action durations (no communication, equal
    stages). The measured bubble is ``1 - busy_s / wall_s``, the analytic one ``analytic_idle_s / wall_s``.
    """

    busy_s: float
    wall_s: float
    analytic_idle_s: float


@runtime_checkable
class PipelineBubbleStats(Protocol):
    """Optional, on a ``CommStats`` of a strategy that runs a pipeline schedule (AccelParallel's).

    With it the ``EfficiencyMonitor`` logs ``pipeline_bubble_frac`` (measured) beside ``pipeline_bubble_frac_analytic``.
    """

    @property
    def pipelined(self) -> bool:
        """Whether a pipeline schedule runs the steps (``False``: the strategy has no pipeline dimension)."""
        ...

    def pop_pipeline_bubble(self) -> PipelineBubble | None:
        """This rank's numbers since the previous call (``None``: no pipeline). Logging steps only: may sync."""
        ...


class StagePlacement(NamedTuple):
    """Which pipeline stages each pipeline rank holds, and this rank's coordinate on the pipeline dimension.

    ``stages[r]`` are the stage indices pipeline rank ``r`` holds, ascending: ``(r,)`` for GPipe and 1F1B,
    ``(r, r + p, ...)`` for the interleaved schedules, ``(r, 2p - 1 - r)`` for the V schedules. A rank's first stage
    is always ``r``; memory is a rank's, so the ``MemoryMonitor`` labels a rank's figures ``stage{r}``.
    """

    pipeline_rank: int
    stages: tuple[tuple[int, ...], ...]
    #: micro-batches of the last training step's loaded batch (1 before the first): what a rank's saved
    #: activations over a step are divided by, for one micro-batch's
    microbatches: int = 1


@runtime_checkable
class PipelineStages(Protocol):
    """Optional, on a strategy that splits the model into pipeline stages (AccelParallel).

    With it the ``MemoryMonitor`` reports the memory of each pipeline rank's stages beside the maximum over ranks.
    """

    @property
    def pipeline_stages(self) -> StagePlacement | None:
        """This rank's place in the pipeline (``None``: no pipeline dimension, or processes not started); no sync."""
        ...
