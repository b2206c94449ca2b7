"""Pipeline schedules by name: which torch class, how many stages per rank, where they sit, what they require.

The bubble of the simple schedules with equal stage times (Narayanan et al., 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 2.2): ``(p - 1) / (m + p - 1)`` of each rank's time for
GPipe and 1F1B with ``p`` stages and ``m`` micro-batches, ``(p - 1) / (v m + p - 1)`` with ``v`` stages per rank
(interleaved). The zero-bubble schedules (Qi et al., 2024) fill it with the weight-gradient halves of backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from packaging.version import Version

__all__ = ["SCHEDULES", "ScheduleName", "ScheduleSpec", "analytic_bubble", "valid_microbatches"]

#: torch releases before this one start a V schedule with a send between the two stages one rank holds, which gloo (the
#: CPU backend) cannot make ("Pair is not connected"): checked failing on 2.11, working on 2.14. A test pins the failure
#: (``test_accel_parallel_guards.py``), so a torch that fixes it is noticed.
V_ON_GLOO_SINCE = Version("2.14")

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What AccelParallel needs to know about one torch schedule."""

    name: str
    torch_class: str
    #: the class takes a list of stages (several per rank possible)
    multi: bool
    #: stages per rank the schedule needs (``None``: any number, default 2)
    fixed_stages_per_rank: int | None
    #: ``"loop"``: rank r holds stages r, r + p, ...; ``"v"``: r and 2p - 1 - r
    style: Literal["loop", "v"]
    #: backward split into input and weight halves (needs FSDP's parameters kept unsharded between them)
    split_backward: bool

    def stages_per_rank(self, requested: int | None) -> int:
        """Stages each rank holds for this schedule (``requested`` or the default)."""
        if self.fixed_stages_per_rank is not None:
            return self.fixed_stages_per_rank
        return 2 if requested is None else requested

    def torch_schedule(self, owner: str) -> type:
        """The torch class; refused with the installed version when this torch does not have it."""
        from torch.distributed import pipelining

        cls = getattr(pipelining, self.torch_class, None)
        if cls is None:
            raise RuntimeError(
                f"{owner}(schedule={self.name!r}) needs torch.distributed.pipelining.{self.torch_class}, which torch"
                f" {torch.__version__} does not have. Fix: upgrade torch, or choose schedule='1f1b'."
            )
        return cls

    def cpu_problem(self) -> str | None:
        """Why this torch cannot run the schedule on CPU processes (gloo), or None."""
        if self.style == "v" and Version(torch.__version__).release < V_ON_GLOO_SINCE.release:
            return (
                f"torch {torch.__version__} starts a V schedule with a send between the two stages of one rank, which"
                f" gloo (CPU) cannot make; torch {V_ON_GLOO_SINCE} can"
            )
        return None

    def build(self, owner: str, stages: list[Any], microbatches: int, loss_fn: Callable[..., Any]) -> Any:
        """The schedule over this rank's ``stages``; the loss is normalised by the caller (``scale_grads=False``)."""
        cls = self.torch_schedule(owner)
        target = stages if self.multi else stages[0]
        return cls(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "ScheduleGPipe", False, 1, "loop", False),
        ScheduleSpec("1f1b", "Schedule1F1B", False, 1, "loop", False),
        ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", True, None, "loop", False),
        ScheduleSpec("looped_bfs", "ScheduleLoopedBFS", True, None, "loop", False),
        ScheduleSpec("zero_bubble", "ScheduleInterleavedZeroBubble", True, None, "loop", True),
        ScheduleSpec("zbv", "ScheduleZBVZeroBubble", True, 2, "v", True),
        ScheduleSpec("dualpipev", "ScheduleDualPipeV", True, 2, "v", True),
    )
}


def microbatch_problem(spec: ScheduleSpec, microbatches: int, pipeline: int, stages_per_rank: int) -> str | None:
    """Why ``microbatches`` cannot run under ``spec`` (torch's own constructor checks, said in advance), or None."""
    stages = pipeline * stages_per_rank
    if spec.name == "1f1b" and microbatches < pipeline:
        return f"1F1B needs at least as many micro-batches as stages ({pipeline})"
    if spec.name == "dualpipev" and microbatches < stages:
        return f"DualPipeV needs at least as many micro-batches as stages ({stages})"
    if spec.name in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, microbatches // pipeline)
        if microbatches % rounds:
            return f"{spec.name} needs a multiple of {rounds} micro-batches (rounds of {pipeline})"
    return None


def valid_microbatches(spec: ScheduleSpec, batch: int, preferred: int, pipeline: int, stages_per_rank: int) -> int:
    """The micro-batch count for a loaded batch of ``batch`` samples: equal micro-batches, the schedule satisfied.

    ``preferred`` when it divides ``batch``; otherwise (a short last batch) the divisor of ``batch`` nearest to it,
    smaller first. 0 when no count works.
    """
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    ordered = sorted(divisors, key=lambda d: (abs(d - preferred), d > preferred))
    for count in ordered:
        if microbatches_ok(spec, count, pipeline, stages_per_rank):
            return count
    return 0


def microbatches_ok(spec: ScheduleSpec, microbatches: int, pipeline: int, stages_per_rank: int) -> bool:
    """Whether the schedule runs with this many micro-batches."""
    return microbatch_problem(spec, microbatches, pipeline, stages_per_rank) is None


def analytic_bubble(spec: ScheduleSpec, microbatches: int, pipeline: int, stages_per_rank: int) -> float:
    """The idle share of a rank's step for equal stage times (module docstring; an upper bound for zero-bubble)."""
    virtual = stages_per_rank if spec.multi else 1
    return (pipeline - 1) / (virtual * microbatches + pipeline - 1)
