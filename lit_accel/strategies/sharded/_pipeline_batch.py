"""The global-batch rule under a pipeline dimension, on top of the shared batch plan (``BatchPlanner``).

One optimizer step is one ``schedule.step()`` over one loaded batch per data-parallel rank, so
``global batch = loaded batch x data-parallel size`` (no accumulation), and the loaded batch is split into equal
pipeline micro-batches: the plan is resolved with ``micro_batches=`` this count (or ``micro_batch_size``) and
``even_micro_batches``. Accumulating over several loaded batches would need several ``step()`` calls, and FSDP
reductions, per optimizer step. At fit start the micro-batch count is checked for the schedule (an error where torch
would refuse it, a warning with the bubble where it merely idles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_accel.layout.batch_plan import no_accumulation
from lit_accel.layout.schedules import analytic_bubble, microbatch_problem

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_accel.layout.batch_plan import BatchPlan
    from lit_accel.strategies.sharded._pipeline import PipelineRunner

__all__ = ["check_no_accumulation", "fit_pipeline"]


def check_no_accumulation(owner: str, trainer: pl.Trainer, plan: BatchPlan | None) -> None:
    """Under a pipeline: refuse an accumulation (the plan's, the Trainer's or a scheduler's), naming the loader fix."""
    accumulation = trainer.accumulate_grad_batches
    scheduled = any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks)
    if accumulation == 1 and not scheduled:
        return
    what = plan.describe() if plan is not None else f"accumulate_grad_batches={accumulation}"
    if scheduled:
        what = "a GradientAccumulationScheduler callback"
    loader = f"DataLoader(batch_size={plan.loaded_batch_size * accumulation}) and " if plan is not None else ""
    fix = f"{loader}Trainer(accumulate_grad_batches=1), or a larger loader batch_size"
    raise ValueError(no_accumulation(owner, what, fix))


def fit_pipeline(owner: str, pipeline: PipelineRunner | None, plan: BatchPlan | None) -> None:
    """This fit's micro-batch count (the batch plan's) given to ``pipeline``, checked against its schedule."""
    if pipeline is None or plan is None:
        return  # no pipeline, or no loader batch size: each batch is split as it comes (``_pipeline.py``)
    pipeline.microbatches = plan.micro_batches
    _check_pipeline_batch(owner, pipeline, plan)


def _check_pipeline_batch(owner: str, pipeline: PipelineRunner, plan: BatchPlan) -> None:
    """The loaded batch against the schedule: refuse what torch refuses, warn when micro-batches leave stages idle."""
    # (the plan's micro-batches are equal: make_batch_plan refused a loaded batch they do not divide)
    problem = microbatch_problem(pipeline.spec, plan.micro_batches, pipeline.pipeline, pipeline.stages_per_rank)
    if problem is not None:
        raise ValueError(
            f"{owner}(schedule={pipeline.spec.name!r}, microbatches={plan.micro_batches}): {problem}. Fix: more"
            f" micro-batches (at least {pipeline.num_stages}), i.e. microbatches= or a larger loader batch_size."
        )
    if plan.micro_batches < pipeline.num_stages:
        bubble = analytic_bubble(pipeline.spec, plan.micro_batches, pipeline.pipeline, pipeline.stages_per_rank)
        rank_zero_warn(
            f"{owner}: {plan.micro_batches} micro-batches for {pipeline.num_stages} pipeline stages leaves each rank"
            f" idle about {bubble:.0%} of a step (the bubble). Fix: at least {pipeline.num_stages} micro-batches."
        )
