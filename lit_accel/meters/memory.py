"""``MemoryMeter``: where a training loop's memory goes on each rank, from tensor metadata, with no host sync.

No Lightning here: any loop (raw PyTorch, Fabric, or the ``MemoryMonitor`` callback, a thin adapter over it) calls
:meth:`MemoryMeter.record_state` at a logging step's optimizer step, wraps one forward in
:meth:`MemoryMeter.activations`, and calls :meth:`MemoryMeter.compute` at logging steps, which gathers one small
vector per rank in one ``all_gather``. Every figure is ``numel x element_size`` of tensors (local shards under FSDP2),
plus the CUDA caching allocator's host-side counters: no device value is read. Keys and formulas: ``docs/monitors.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_accel.meters._allocator import AllocatorStats, CudaAllocatorStats
from lit_accel.meters._memory_metrics import (
    DtypeBytes,
    RankMemory,
    lever_savings,
    memory_metrics,
    per_stage,
    stage_metrics,
)
from lit_accel.meters._memory_probe import SavedTensorProbe, Sized, size_tensors, state_tensors
from lit_accel.utilities._torch_fallbacks import all_gather_single
from lit_accel.utilities._validation import check_int

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["MemoryMeter", "SavedTensorProbe"]


class MemoryMeter:
    """Measure parameters, gradients, optimizer state, activations and the CUDA allocator's peaks, per rank.

    Call :meth:`record_state` just before a logging step's optimizer step (gradients are complete, not yet zeroed;
    once per optimizer), wrap the forward of a training micro-batch in :meth:`activations` (it measures the first
    one that saves tensors, then does nothing), and call :meth:`compute` at logging steps on every rank (it
    gathers). Values are the maximum over ranks, plus ``*_spread`` (max / min) where ranks differ, and with a
    ``stage`` label on every rank ``stage{k}/<name>_mb``, the maximum over the ranks labelled ``k``.

    Args:
        device: the device the loop runs on (CUDA: the allocator's peaks and counters are read too).
        world_size: ranks taking part (default: the process group's, 1 without one).
        allocator: where the allocator's peaks and counters come from (default: the CUDA device's caching allocator
            on a CUDA ``device``, none elsewhere). Peaks restart at construction and at every :meth:`reset`.
        stage: this rank's pipeline stage label (an int >= 0; a rank holding several stages: its pipeline
            coordinate, ``StagePlacement``), gathered with the row; ``None``: no per-stage figures.

    Raises:
        TypeError, ValueError: a ``world_size`` that is not an int >= 1, a ``stage`` that is not an int >= 0.

    Example::

        meter = MemoryMeter(device)
        for step, (x, y) in enumerate(loader):
            with meter.activations(model):
                loss = loss_fn(model(x), y)
            loss.backward()
            if (step + 1) % 50 == 0:
                meter.record_state(model, opt)
            opt.step(); opt.zero_grad()
            if (step + 1) % 50 == 0:
                print(meter.compute(step))  # every rank calls compute(): it gathers
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        world_size: int | None = None,
        allocator: AllocatorStats | None = None,
        stage: int | None = None,
    ) -> None:
        check_int("MemoryMeter", "world_size", world_size, allow_none=True, example=8)
        check_int("MemoryMeter", "stage", stage, minimum=0, allow_none=True, example=0)
        self.device = torch.device(device)
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.world_size = world_size
        self.stage = stage
        self.cuda = self.device.type == "cuda"
        self.allocator = allocator if allocator is not None or not self.cuda else CudaAllocatorStats(self.device)
        #: ``{"step": index, **metrics}`` of every :meth:`compute`.
        self.history: list[dict[str, float]] = []
        #: Every rank's numbers at the last :meth:`compute`.
        self.rows: list[RankMemory] = []
        #: Every rank's stage label at the last :meth:`compute` (``None`` where a rank has none).
        self.stages: list[int | None] = []
        self._params: Sized | None = None
        self._per_optimizer: dict[int, tuple[Sized, Sized]] = {}
        self._activations: tuple[DtypeBytes, float] | None = None
        self._probe: SavedTensorProbe | None = None
        self._cuda_at_start = (0.0, 0.0)
        self.reset()

    def reset(self) -> None:
        """Forget everything measured (a new fit): state, activations, history; allocator peaks and counters restart."""
        self.history, self.rows, self.stages = [], [], []
        self._params, self._per_optimizer, self._activations = None, {}, None
        if self._probe is not None and self._probe.active:
            self._probe.stop()
        self._probe = None
        if self.allocator is not None:
            self.allocator.reset_peaks()  # else a second fit in this process reports the first one's peak
            self._cuda_at_start = self.allocator.counters()

    # ------------------------------------------------------------------ state (at logging steps)

    def record_state(self, model: nn.Module | Iterable[Tensor], optimizer: Optimizer | None = None) -> None:
        """Size the parameters of ``model`` and the gradients and state of ``optimizer`` (its parameters' grads).

        A Python loop over the parameters: call it at logging steps only. With several optimizers, once for each.
        """
        params = model.parameters() if isinstance(model, nn.Module) else model
        self._params = size_tensors(params)
        if optimizer is not None:
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            grads = size_tensors(p.grad for p in owned if p.grad is not None)
            state = size_tensors(t for s in optimizer.state.values() for t in state_tensors(s))
            self._per_optimizer[id(optimizer)] = (grads, state)

    @property
    def state_recorded(self) -> bool:
        """Whether :meth:`record_state` ran since the last :meth:`reset`."""
        return self._params is not None

    # ------------------------------------------------------------------ activations (once)

    @property
    def activations_measured(self) -> bool:
        """Whether a forward's saved tensors were measured."""
        return self._activations is not None

    def start_activations(self, model: nn.Module | Iterable[Tensor]) -> bool:
        """Start measuring the saved tensors of the forward that follows; ``False`` when measured already."""
        if self._activations is not None or (self._probe is not None and self._probe.active):
            return False
        params = model.parameters() if isinstance(model, nn.Module) else model
        self._probe = SavedTensorProbe(params)
        self._probe.start()
        return True

    def stop_activations(self, forwards: int = 1) -> None:
        """End the measurement (before the backward); a forward that saved nothing is not a measurement.

        ``forwards``: the micro-batches whose forwards ran in it (a pipeline runs a loaded batch's inside one
        training step): the figures are one micro-batch's, the mean.
        """
        if self._probe is None or not self._probe.active:
            return
        activations, casts = self._probe.stop()
        self._probe = None
        if activations.total + casts > 0:
            per = DtypeBytes()
            for slot, nbytes in activations.nonzero().items():
                per.add(slot, nbytes / forwards)
            self._activations = (per, casts / forwards)

    @contextmanager
    def activations(self, model: nn.Module | Iterable[Tensor]) -> Iterator[None]:
        """Measure the forward in the block, unless one was measured already (then it costs nothing)."""
        started = self.start_activations(model)
        try:
            yield
        finally:
            if started:
                self.stop_activations()

    # ------------------------------------------------------------------ logging steps

    def local_row(self) -> RankMemory:
        """This rank's numbers now (no collective)."""
        row = RankMemory()
        if self._params is not None:
            row.state_recorded = 1.0
            row.params, row.params_unsharded = self._params.local, self._params.unsharded
            grads, state = Sized(), Sized()
            for g, s in self._per_optimizer.values():
                grads += g
                state += s
            row.grads, row.grads_unsharded = grads.local, grads.unsharded
            row.optimizer, row.optimizer_unsharded = state.local, state.unsharded
        if self._activations is not None:
            row.activations_measured = 1.0
            row.activations, row.param_casts = self._activations
        if self.allocator is not None:  # the caching allocator's host-side statistics: no device sync
            row.peak_allocated, row.peak_reserved = self.allocator.peaks()
            retries, ooms = self.allocator.counters()
            row.alloc_retries, row.ooms = retries - self._cuda_at_start[0], ooms - self._cuda_at_start[1]
        return row

    def compute(self, step: int | None = None) -> dict[str, float]:
        """Every rank's numbers (one ``all_gather``) as metrics; every rank must call it.

        Args:
            step: the index recorded with the metrics in :attr:`history` (default: the number of calls so far).
        """
        self.rows, self.stages = self._gather(self.local_row())
        metrics = self._metrics()
        self.history.append({"step": len(self.history) if step is None else step, **metrics})
        return metrics

    def _metrics(self) -> dict[str, float]:
        cuda = self.allocator is not None
        return {**memory_metrics(self.rows, cuda), **stage_metrics(self.rows, self.stages, cuda)}

    def _gather(self, row: RankMemory) -> tuple[list[RankMemory], list[int | None]]:
        """Every rank's row and stage label; the label travels as the vector's last number (-1: none)."""
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [row], [self.stage]
        values = [*row.vector(), -1.0 if self.stage is None else float(self.stage)]
        device = self.device if self.cuda else torch.device("cpu")  # gloo gathers CPU tensors, NCCL CUDA ones
        local = torch.tensor(values, dtype=torch.float64, device=device)
        gathered = torch.empty(self.world_size * len(values), dtype=torch.float64, device=device)
        all_gather_single(gathered, local)
        ranks = gathered.reshape(self.world_size, -1).cpu().tolist()
        return [RankMemory.from_vector(r[:-1]) for r in ranks], [int(r[-1]) if r[-1] >= 0 else None for r in ranks]

    def summary(self) -> dict[str, float]:
        """The last :meth:`compute`'s metrics and what each lever saved (``lever_savings``); empty before."""
        if not self.rows:
            return {}
        return {**self._metrics(), **lever_savings(self.rows)}

    def report(self) -> dict[str, Any]:
        """The JSON report: configuration, the summary, every rank's bytes by dtype, and every logged value.

        With stage labels, each rank's ``stage`` and ``per_stage``: each label's ranks and ``*_mb`` metrics.
        """
        per_rank = [{"rank": rank, **row.as_dict()} for rank, row in enumerate(self.rows)]
        report = {
            "config": {"device": str(self.device), "world_size": self.world_size},
            "summary": self.summary(),
            "per_rank": per_rank,
            "history": self.history,
        }
        stages = per_stage(self.rows, self.stages, self.allocator is not None)
        if stages:
            for entry, stage in zip(per_rank, self.stages):
                entry["stage"] = stage
            ranks = {k: [r for r, label in enumerate(self.stages) if label == k] for k in stages}
            report["per_stage"] = [{"stage": k, "ranks": ranks[k], **metrics} for k, metrics in stages.items()]
        return report
