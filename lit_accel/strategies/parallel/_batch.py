"""The global-batch rule under a pipeline dimension, on the shared :class:`~lit_accel.BatchPlan`.

One optimizer step is one ``schedule.step()`` over one loaded batch per data-parallel rank, so
``global batch = loaded batch x data-parallel size`` (no accumulation) and the loaded batch is split into equal
pipeline micro-batches. Accumulating over several loaded batches would need several ``step()`` calls, and FSDP
reductions, per optimizer step.
"""

from __future__ import annotations

from lit_accel.strategies.batch_plan import BatchPlan, make_batch_plan, nearest_divisors

__all__ = ["plan_pipeline_batch"]


def plan_pipeline_batch(
    owner: str,
    loaded: int,
    data: int,
    *,
    global_batch_size: int | None,
    microbatches: int | None,
    micro_batch_size: int | None,
    num_stages: int,
    accumulation: int,
) -> BatchPlan:
    """The pipeline's batch plan, or a ``ValueError`` naming the values and the fix.

    ``microbatches`` (a count) wins over ``micro_batch_size``; with neither, ``2 x num_stages`` micro-batches.
    """
    count = microbatches if microbatches is not None or micro_batch_size is not None else 2 * num_stages
    if count is not None:
        if loaded % count:
            raise ValueError(
                f"{owner}(microbatches={count}): the loaded batch of {loaded} does not split into {count} equal"
                f" pipeline micro-batches. Fix: microbatches={' or '.join(map(str, nearest_divisors(loaded, count)))},"
                f" or a loader batch_size that is a multiple of {count}."
            )
        micro_batch_size = loaded // count
    plan = make_batch_plan(global_batch_size, loaded, data, micro_batch_size, accumulate_grad_batches=accumulation,
                           even_micro_batches=True, owner=owner)  # fmt: skip
    if plan.accumulate_grad_batches != 1:
        size = loaded * plan.accumulate_grad_batches
        raise ValueError(
            f"{owner}: {plan.describe()}; under a pipeline one optimizer step is one pass over one loaded batch, so"
            f" there is no accumulation. Fix: DataLoader(batch_size={size}) and Trainer(accumulate_grad_batches=1)."
        )
    return plan
