"""The global-batch rule under a pipeline dimension, as one pure function (swappable for the shared batch plan).

One optimizer step is one ``schedule.step()`` over one loaded batch per data-parallel rank, so
``global batch = loaded batch x data-parallel size`` and the loaded batch is split into ``m`` pipeline micro-batches.
Accumulating over several loaded batches would need several ``step()`` calls (and FSDP reductions) per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineBatch", "plan_pipeline_batch"]


@dataclass(frozen=True)
class PipelineBatch:
    """``global_batch_size = loaded x data``; each loaded batch is ``microbatches`` pipeline micro-batches."""

    global_batch_size: int
    loaded: int
    data: int
    microbatches: int

    def describe(self) -> str:
        """The decomposition as one line."""
        return (
            f"global batch {self.global_batch_size} = {self.loaded} per data-parallel rank x {self.data} ranks;"
            f" each loaded batch in {self.microbatches} pipeline micro-batches of {self.loaded // self.microbatches}"
        )


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
) -> PipelineBatch:
    """The pipeline's batch decomposition, or a ``ValueError`` naming the values and the fix.

    ``microbatches`` wins over ``micro_batch_size``; with neither, ``2 x num_stages`` micro-batches.
    """
    if accumulation != 1:
        raise ValueError(
            f"{owner}: Trainer(accumulate_grad_batches={accumulation}) under a pipeline dimension; one optimizer step"
            " is one pipeline pass over one loaded batch. Fix: accumulate_grad_batches=1 and a loader batch_size"
            f" {accumulation}x larger (it is split into pipeline micro-batches)."
        )
    if global_batch_size is not None and global_batch_size != loaded * data:
        size = global_batch_size // data if global_batch_size % data == 0 else None
        fix = f"DataLoader(batch_size={size})" if size else f"a global_batch_size that is a multiple of {data}"
        raise ValueError(
            f"{owner}(global_batch_size={global_batch_size}) != loaded batch {loaded} x {data} data-parallel ranks."
            f" Fix: {fix}."
        )
    if microbatches is None and micro_batch_size is not None:
        if loaded % micro_batch_size:
            raise ValueError(
                f"{owner}(micro_batch_size={micro_batch_size}) does not divide the loaded batch of {loaded}. Fix: a"
                f" divisor of {loaded}."
            )
        microbatches = loaded // micro_batch_size
    if microbatches is None:
        microbatches = 2 * num_stages
    if loaded % microbatches:
        fits = [d for d in range(1, loaded + 1) if loaded % d == 0]
        raise ValueError(
            f"{owner}: the loaded batch of {loaded} does not split into {microbatches} equal pipeline micro-batches."
            f" Fix: microbatches= one of {fits}, or a loader batch_size that is a multiple of {microbatches}."
        )
    return PipelineBatch(loaded * data, loaded, data, microbatches)
