"""``ParallelPlan``: the sharded strategy's layout resolved once, from its arguments and a world size.

torchtitan's ``ParallelDims`` is the model: one frozen value, the data-sharded size inferred, validated where it is
built. It needs no process group, so a plan can be made for a world that is not this machine's (what a memory
planner's row holds). The strategy builds it in its constructor for the smallest world its sizes fit (so that every
refusal comes before the processes start), sizes it for the real world in ``setup_environment``, and every part
reads its choices from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lit_accel.layout import blocks as _blocks
from lit_accel.layout.mesh import ParallelLayout
from lit_accel.layout.schedules import SCHEDULES, ScheduleName, ScheduleSpec, microbatch_problem
from lit_accel.layout.stages import check_pipeline_loss, loose_parameters
from lit_accel.layout.tensor_plan import TensorPlan, check_plan
from lit_accel.protocols import StagePlacement
from lit_accel.utilities._validation import check_bool, check_choice, check_int

__all__ = ["COMPUTE_DTYPES", "ParallelPlan"]

#: each mixed precision's compute dtype: autocast's, and FSDP's for the parameters it gathers (``param_dtype``)
COMPUTE_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp8-mixed": torch.bfloat16}


@dataclass(frozen=True)
class ParallelPlan:
    """The mesh sizes, the resolved schedule, what a pipeline needs and how the model is sharded, for one world.

    Example::

        plan = ParallelPlan.build("AccelParallel", 16, pipeline_parallel=2, tensor_parallel=2)
        plan.layout.data_shard  # 4: what the other sizes leave of 16
        plan.describe()  # "pipeline 2 x data 4 (sharded) x tensor 2 = 16 processes; schedule 1f1b, 2 stages"
        plan.for_world("AccelParallel", 64).layout.data_shard  # 16

    Attributes:
        layout: the four mesh sizes (``data_shard`` inferred).
        schedule: the schedule's spec (its torch class, stages per rank, style), not its name.
        stages_per_rank: stages each pipeline rank holds (the schedule's, or the requested count).
        microbatches: pipeline micro-batches per loaded batch as given (``None``: from the batch plan).
        stage_split: ``"auto"`` or the unit names where stages 1, 2, ... begin.
        reshard_after_forward: FSDP's, resolved: ``True`` without a pipeline, ``False`` under one, unless given.
        tensor_plan: as given (``"auto"``, ``None`` or module name -> style); resolved against the model at build.
        shard_policy: which modules FSDP shards as blocks (as ``AccelFSDP``'s).
        reduce_dtype, param_dtype: FSDP's gradient-reduction and parameter dtypes (``param_dtype`` from the
            precision plugin, set by :meth:`for_world`; ``None``: the parameters' own).
        context_parallel: the sequence-parallel size (only 1 runs today).
        activation_checkpointing: recompute blocks' activations in backward: ``True`` (the blocks ``shard_policy``
            finds), ``False``, or a policy like ``shard_policy``; on every stage, with or without sharding.
        cpu_offload: FSDP keeps parameters, gradients and optimizer state on the CPU (it then shards even over one
            data rank).
    """

    layout: ParallelLayout
    schedule: ScheduleSpec
    stages_per_rank: int
    microbatches: int | None
    stage_split: Literal["auto"] | tuple[str, ...]
    reshard_after_forward: bool
    tensor_plan: TensorPlan = "auto"
    shard_policy: _blocks.ShardPolicy = "auto"
    reduce_dtype: torch.dtype | None = torch.float32
    param_dtype: torch.dtype | None = None
    context_parallel: int = 1
    activation_checkpointing: bool | _blocks.ShardPolicy = False
    cpu_offload: bool = False

    @classmethod
    def build(
        cls, owner: str, world_size: int | None, *, pipeline_parallel: int = 1, tensor_parallel: int = 1,
        data_replicate: int = 1, context_parallel: int = 1, schedule: ScheduleName = "1f1b",
        stages_per_rank: int | None = None, microbatches: int | None = None,
        stage_split: Literal["auto"] | Sequence[str] = "auto", tensor_plan: TensorPlan = "auto",
        shard_policy: _blocks.ShardPolicy = "auto", reshard_after_forward: bool | None = None,
        reduce_dtype: torch.dtype | None = torch.float32, activation_checkpointing: bool | _blocks.ShardPolicy = False,
        cpu_offload: bool = False,
    ) -> ParallelPlan:  # fmt: skip
        """The plan of ``world_size`` processes (``None``: the smallest world the sizes fit, ``data_shard`` 1).

        Every argument is checked here by name; every refusal names the value and the fix.

        Raises:
            ValueError: sizes whose product does not divide ``world_size``, an unknown schedule (or one this torch
                lacks), a stage count the schedule does not take, a micro-batch count it refuses, resharding under
                a split-backward schedule.
            TypeError: a size or count that is not an int, a split, reshard flag or dtype of the wrong type.
        """
        for name, value in (("pipeline_parallel", pipeline_parallel), ("tensor_parallel", tensor_parallel),
                            ("data_replicate", data_replicate), ("context_parallel", context_parallel)):  # fmt: skip
            check_int(owner, name, value, example=2)
        check_int(owner, "stages_per_rank", stages_per_rank, allow_none=True, example=2)
        check_int(owner, "microbatches", microbatches, allow_none=True, example=8)
        check_choice(owner, "schedule", schedule, tuple(SCHEDULES), "'1f1b'")
        check_plan(owner, tensor_plan)
        _blocks.check_policy(owner, "shard_policy", shard_policy)
        if not isinstance(activation_checkpointing, bool):
            _blocks.check_policy(owner, "activation_checkpointing", activation_checkpointing)
        check_bool(owner, "cpu_offload", cpu_offload)
        _check_types(owner, stage_split, reshard_after_forward, reduce_dtype)
        given = pipeline_parallel * tensor_parallel * data_replicate
        layout = ParallelLayout.from_world(owner, given if world_size is None else world_size, pipeline_parallel,
                                           tensor_parallel, data_replicate)  # fmt: skip
        spec = SCHEDULES[schedule]
        per_rank = _stages_per_rank(owner, spec, stages_per_rank, pipeline_parallel)
        _check_pipeline(owner, spec, pipeline_parallel, per_rank, microbatches, reshard_after_forward)
        if pipeline_parallel > 1 and spec.split_backward and activation_checkpointing is not False:
            raise ValueError(
                f"{owner}(schedule={spec.name!r}, activation_checkpointing={activation_checkpointing!r}): a"
                " split-backward schedule takes the input and the weight gradients in two passes, which torch's"
                " checkpoint cannot recompute for. Fix: activation_checkpointing=False, or schedule='1f1b' or"
                " 'interleaved_1f1b'."
            )
        split: Literal["auto"] | tuple[str, ...] = "auto" if stage_split == "auto" else tuple(stage_split)
        # torchtitan's choice: a pipeline's stages keep their parameters from the forward to the backward
        reshard = pipeline_parallel == 1 if reshard_after_forward is None else reshard_after_forward
        return cls(layout, spec, per_rank, microbatches, split, reshard, tensor_plan, shard_policy, reduce_dtype,
                   context_parallel=context_parallel, activation_checkpointing=activation_checkpointing,
                   cpu_offload=cpu_offload)  # fmt: skip

    def for_world(self, owner: str, world_size: int, *, param_dtype: torch.dtype | None = None) -> ParallelPlan:
        """This plan with its data-sharded size inferred from ``world_size`` (and the precision's parameter dtype).

        Raises:
            ValueError: the sizes do not divide ``world_size``.
        """
        check_int(owner, "world_size", world_size, example=2)
        layout = self.layout
        layout = ParallelLayout.from_world(owner, world_size, layout.pipeline, layout.tensor, layout.data_replicate)
        return dataclasses.replace(self, layout=layout, param_dtype=param_dtype)

    def pipeline_split(self, micro_batch_size: object) -> dict[str, Any]:
        """``AccelParts.setup``'s keywords: a pipeline splits each batch itself into its planned count; else none."""
        if self.layout.pipeline == 1:
            return {}
        # the given count; else None where micro_batch_size splits; else twice the stages
        count = (
            self.microbatches if self.microbatches is not None or micro_batch_size is not None else 2 * self.num_stages
        )
        return {"splits_batches": True, "micro_batches": count}

    def check_model(self, owner: str, module: nn.Module, precision: object) -> None:
        """Refuse a model or precision this layout cannot train, before anything is built (setup; the planner's row).

        A pipeline needs ``pipeline_loss``; float8 Linear layers take no tensor dimension; under a pipeline or tensor
        dimension every parameter belongs to a unit (a stage or an FSDP group owns it).

        Raises:
            TypeError: a pipeline without ``pipeline_loss``.
            ValueError: fp8 with a tensor dimension; a parameter outside every unit.
        """
        layout = self.layout
        check_pipeline_loss(owner, module, layout.pipeline)
        if precision == "fp8-mixed" and layout.tensor > 1:
            raise ValueError(
                f"{owner}(tensor_parallel={layout.tensor}) with fp8-mixed: float8 Linear layers need torchao's float8"
                " tensor-parallel styles, which AccelParallel does not apply. Fix: bf16-mixed, or tensor_parallel=1."
            )
        loose = loose_parameters(module) if layout.pipeline > 1 or layout.tensor > 1 else []
        if loose:
            raise ValueError(
                f"{owner}: parameter {loose[0]!r} belongs to no module unit, so no stage or FSDP group can own it. Fix:"
                " hold it in a submodule (e.g. an nn.Module wrapping the nn.Parameter)."
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.layout.pipeline * self.stages_per_rank

    @property
    def sharded(self) -> bool:
        """Whether the model is FSDP-sharded: always, but for a pipeline over one data rank without tensor or offload.

        Without a pipeline even one data rank shards (AccelFSDP's layout, one code path); with a tensor dimension every
        parameter is then a DTensor, since torch's fp16 unscale cannot take plain and distributed gradients in one call.
        """
        layout = self.layout
        return layout.pipeline == 1 or layout.data > 1 or layout.tensor > 1 or self.cpu_offload

    def stage_ids(self, pipeline_rank: int) -> list[int]:
        """The stages a pipeline rank holds: looped ``(r, r + p, ...)``, or a V's ``(r, 2p - 1 - r)``."""
        pipeline = self.layout.pipeline
        if self.schedule.style == "v" and pipeline > 1:
            return [pipeline_rank, 2 * pipeline - 1 - pipeline_rank]
        return [pipeline_rank + k * pipeline for k in range(self.stages_per_rank)]

    def placement(self, rank: int, microbatches: int = 1) -> StagePlacement:
        """Global ``rank``'s pipeline coordinate and the stages of every pipeline rank, as the model is built."""
        held = tuple(tuple(self.stage_ids(r)) for r in range(self.layout.pipeline))
        return StagePlacement(self.layout.coordinates(rank)[0], held, microbatches)

    def data_groups(self, group_size: int | None = None) -> list[list[int]]:
        """The ranks of each data dimension (one pipeline and tensor coordinate), in groups of ``group_size``.

        What synchronises BatchNorm statistics: ranks that see different samples, never a stage's or a tensor
        shard's peers (``None``: the whole data dimension).
        """
        layout = self.layout
        by_coordinate: dict[tuple[int, int], list[int]] = {}
        for rank in range(layout.world_size):
            pipeline, _, _, tensor = layout.coordinates(rank)
            by_coordinate.setdefault((pipeline, tensor), []).append(rank)
        size = group_size or layout.data
        return [ranks[i : i + size] for ranks in by_coordinate.values() for i in range(0, len(ranks), size)]

    def describe(self) -> str:
        """One line: the layout, and with a pipeline its schedule and stages."""
        text = self.layout.describe()
        if self.layout.pipeline > 1:
            text += f"; schedule {self.schedule.name}, {self.num_stages} stages"
        return text


def _check_types(owner: str, split: object, reshard: object, dtype: object) -> None:
    if split != "auto" and (isinstance(split, str) or not isinstance(split, Sequence)):
        raise TypeError(f"{owner}(stage_split={split!r}): expected 'auto' or a list of unit names. Fix: 'auto'.")
    if reshard is not None and not isinstance(reshard, bool):
        raise TypeError(f"{owner}(reshard_after_forward={reshard!r}): expected True, False or None. Fix: None.")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}(reduce_dtype={dtype!r}): expected a torch.dtype or None. Fix: torch.float32.")


def _stages_per_rank(owner: str, spec: ScheduleSpec, requested: int | None, pipeline: int) -> int:
    if requested is not None and spec.fixed_stages_per_rank not in (None, requested):
        raise ValueError(
            f"{owner}(schedule={spec.name!r}, stages_per_rank={requested}): this schedule holds"
            f" {spec.fixed_stages_per_rank} stage(s) per rank. Fix: drop stages_per_rank, or use 'interleaved_1f1b'."
        )
    return spec.stages_per_rank(requested) if pipeline > 1 else 1


def _check_pipeline(
    owner: str, spec: ScheduleSpec, pipeline: int, per_rank: int, microbatches: int | None, reshard: bool | None
) -> None:
    if pipeline == 1:
        return
    spec.torch_schedule(owner)  # a schedule this torch lacks is refused now, naming the version
    problem = None if microbatches is None else microbatch_problem(spec, microbatches, pipeline, per_rank)
    if problem is not None:
        raise ValueError(
            f"{owner}(schedule={spec.name!r}, microbatches={microbatches}): {problem}. Fix: more micro-batches"
            f" (at least {pipeline * per_rank}), i.e. microbatches= or a larger loader batch_size."
        )
    if spec.split_backward and reshard:
        # torch: the last stage's gradients stay None (InterleavedZeroBubble, ZBV); DualPipeV's are off by 6e-2.
        raise ValueError(
            f"{owner}(schedule={spec.name!r}, reshard_after_forward=True): split-backward schedules need each stage's"
            " parameters kept from forward to the weight gradient; resharding after forward loses them. Fix:"
            " reshard_after_forward=None (False under a pipeline)."
        )
