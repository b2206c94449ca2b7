"""``ParallelPlan``: the sharded strategy's layout resolved once, from its arguments and a world size.

torchtitan's ``ParallelDims`` is the model: one frozen value, the data-sharded size inferred, validated where it is
built. It needs no process group, so a plan can be made for a world that is not this machine's (what a memory
planner's row holds). The strategy builds it when the world size is known and reads its layout from it (issue #48:
the other parts move onto it step by step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lit_accel.strategies.parallel._layout import ParallelLayout
from lit_accel.strategies.parallel._schedules import SCHEDULES, ScheduleSpec, microbatch_problem
from lit_accel.utilities._validation import check_choice, check_int

__all__ = ["ParallelPlan"]


@dataclass(frozen=True)
class ParallelPlan:
    """The mesh sizes, the resolved schedule and what a pipeline needs, for one world size.

    Example::

        plan = ParallelPlan.build("AccelParallel", 16, pipeline_parallel=2, tensor_parallel=2)
        plan.layout.data_shard  # 4: what the other sizes leave of 16
        plan.describe()  # "pipeline 2 x data 4 (sharded) x tensor 2 = 16 processes; schedule 1f1b, 2 stages"

    Attributes:
        layout: the four mesh sizes (``data_shard`` inferred).
        schedule: the schedule's spec (its torch class, stages per rank, style), not its name.
        stages_per_rank: stages each pipeline rank holds (the schedule's, or the requested count).
        microbatches: pipeline micro-batches per loaded batch as given (``None``: from the batch plan).
        stage_split: ``"auto"`` or the unit names where stages 1, 2, ... begin.
        reshard_after_forward: FSDP's, resolved: ``True`` without a pipeline, ``False`` under one, unless given.
    """

    layout: ParallelLayout
    schedule: ScheduleSpec
    stages_per_rank: int
    microbatches: int | None
    stage_split: Literal["auto"] | tuple[str, ...]
    reshard_after_forward: bool

    @classmethod
    def build(
        cls, owner: str, world_size: int, *, pipeline_parallel: int = 1, tensor_parallel: int = 1,
        data_replicate: int = 1, schedule: str = "1f1b", stages_per_rank: int | None = None,
        microbatches: int | None = None, stage_split: Literal["auto"] | Sequence[str] = "auto",
        reshard_after_forward: bool | None = None,
    ) -> ParallelPlan:  # fmt: skip
        """The plan of ``world_size`` processes; every refusal names the value and the fix.

        Raises:
            ValueError: sizes whose product does not divide ``world_size``, an unknown schedule, a stage count
                the schedule does not take, or a micro-batch count it refuses.
            TypeError: a size or count that is not an int.
        """
        for name, value in (("world_size", world_size), ("pipeline_parallel", pipeline_parallel),
                            ("tensor_parallel", tensor_parallel), ("data_replicate", data_replicate)):  # fmt: skip
            check_int(owner, name, value, example=2)
        check_int(owner, "stages_per_rank", stages_per_rank, allow_none=True, example=2)
        check_int(owner, "microbatches", microbatches, allow_none=True, example=8)
        check_choice(owner, "schedule", schedule, tuple(SCHEDULES), "'1f1b'")
        layout = ParallelLayout.from_world(owner, world_size, pipeline_parallel, tensor_parallel, data_replicate)
        spec = SCHEDULES[schedule]
        if stages_per_rank is not None and spec.fixed_stages_per_rank not in (None, stages_per_rank):
            raise ValueError(
                f"{owner}(schedule={spec.name!r}, stages_per_rank={stages_per_rank}): this schedule holds"
                f" {spec.fixed_stages_per_rank} stage(s) per rank. Fix: drop stages_per_rank, or use"
                " 'interleaved_1f1b'."
            )
        per_rank = spec.stages_per_rank(stages_per_rank) if pipeline_parallel > 1 else 1
        problem = None if microbatches is None or pipeline_parallel == 1 else (
            microbatch_problem(spec, microbatches, pipeline_parallel, per_rank))  # fmt: skip
        if problem is not None:
            raise ValueError(
                f"{owner}(schedule={spec.name!r}, microbatches={microbatches}): {problem}. Fix: more micro-batches"
                f" (at least {pipeline_parallel * per_rank}), i.e. microbatches= or a larger loader batch_size."
            )
        split: Any = stage_split if stage_split == "auto" else tuple(stage_split)
        # torchtitan's choice: a pipeline's stages keep their parameters from the forward to the backward
        reshard = pipeline_parallel == 1 if reshard_after_forward is None else reshard_after_forward
        return cls(layout, spec, per_rank, microbatches, split, reshard)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.layout.pipeline * self.stages_per_rank

    def describe(self) -> str:
        """One line: the layout, and with a pipeline its schedule and stages."""
        text = self.layout.describe()
        if self.layout.pipeline > 1:
            text += f"; schedule {self.schedule.name}, {self.num_stages} stages"
        return text
