"""``BatchPlan``: one global batch as loaded batches, micro-batches, accumulation and data-parallel ranks.

Pure Python (no torch, no Lightning), so every strategy shares it and it is property-tested without processes. The
rule (Goyal et al., 2017, "Accurate, Large Minibatch SGD", section 2)::

    global_batch_size = loaded_batch_size x accumulate_grad_batches x data_parallel_size

A *loaded batch* is what the train dataloader yields on one data-parallel rank; the accumulation counts loaded
batches. Each loaded batch runs as ``micro_batches`` chunks of at most ``micro_batch_size`` samples (gradient
micro-batching, or a pipeline's micro-batches): the split changes memory, never the accumulation or the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "BatchPlan",
    "loaded_batch_size_of",
    "make_batch_plan",
    "nearest_divisors",
    "nearest_global_batch_sizes",
    "no_accumulation",
]


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are loaded, split and accumulated; made by :func:`make_batch_plan`.

    Attributes:
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        loaded_batch_size: samples per loaded batch on one data-parallel rank (the train dataloader's batch size).
        micro_batch_size: samples per forward/backward chunk of a loaded batch (the last chunk may be smaller).
        micro_batches: chunks per loaded batch, ``ceil(loaded_batch_size / micro_batch_size)``.
        accumulate_grad_batches: loaded batches per optimizer step on each rank (Lightning's setting).
        data_parallel_size: ranks that each load different samples (the world size, or a mesh's data dimension).
    """

    global_batch_size: int
    loaded_batch_size: int
    micro_batch_size: int
    micro_batches: int
    accumulate_grad_batches: int
    data_parallel_size: int

    def describe(self) -> str:
        """The plan as one line, e.g. ``global batch 64 = 16 loaded x 2 accumulation x 2 data-parallel ranks``."""
        ranks = "rank" if self.data_parallel_size == 1 else "ranks"
        line = (
            f"global batch {self.global_batch_size} = {self.loaded_batch_size} loaded x {self.accumulate_grad_batches}"
            f" accumulation x {self.data_parallel_size} data-parallel {ranks}"
        )
        if self.micro_batches > 1:
            line += f", each loaded batch as {self.micro_batches} micro-batches of {self.micro_batch_size}"
        return line

    def with_micro_batch_size(self, micro_batch_size: int) -> BatchPlan:
        """The same plan with loaded batches split into chunks of ``micro_batch_size`` (at most the loaded batch)."""
        micro = _positive("BatchPlan", "micro_batch_size", micro_batch_size)
        micro = min(micro, self.loaded_batch_size)
        return replace(self, micro_batch_size=micro, micro_batches=-(-self.loaded_batch_size // micro))


def nearest_global_batch_sizes(
    global_batch_size: int, loaded_batch_size: int, data_parallel_size: int
) -> tuple[int, ...]:
    """The valid global batch sizes (positive multiples of ``loaded x data-parallel``) nearest below and above."""
    step = loaded_batch_size * data_parallel_size
    below = (global_batch_size // step) * step
    above = -(-global_batch_size // step) * step
    return tuple(sorted({size for size in (below, above) if size >= step}))


def nearest_divisors(number: int, near: int) -> tuple[int, ...]:
    """The divisors of ``number`` nearest below and above ``near`` (one when ``near`` divides it)."""
    divisors = set()
    for i in range(1, math.isqrt(number) + 1):
        if number % i == 0:
            divisors.update((i, number // i))
    below = [d for d in sorted(divisors) if d <= near][-1:]
    above = [d for d in sorted(divisors) if d >= near][:1]
    return tuple(sorted({*below, *above}))


def make_batch_plan(
    global_batch_size: int | None,
    loaded_batch_size: int,
    data_parallel_size: int,
    micro_batch_size: int | None = None,
    *,
    accumulate_grad_batches: int = 1,
    even_micro_batches: bool = False,
    micro_batches: int | None = None,
    accumulates: bool = True,
    owner: str = "AccelDDP",
) -> BatchPlan:
    """Make the plan, or say in one error which size is wrong and the nearest valid choices.

    Args:
        global_batch_size: samples per optimizer step over all ranks; ``None`` keeps ``accumulate_grad_batches``.
        loaded_batch_size: the train dataloader's batch size on one data-parallel rank.
        data_parallel_size: ranks that load different samples.
        micro_batch_size: chunk size each loaded batch is split into; ``None``: not split.
        accumulate_grad_batches: the Trainer's setting; with ``global_batch_size`` it must be 1 or the same.
        even_micro_batches: require ``micro_batch_size`` to divide the loaded batch (pipeline schedules).
        micro_batches: split each loaded batch into this many equal micro-batches instead (a pipeline's count; it
            must divide the loaded batch, and wins over ``micro_batch_size``).
        accumulates: whether a step may take several loaded batches (a pipeline's takes one: the global batch must
            then be one loaded batch per rank).
        owner: the class named in error messages.

    Raises:
        ValueError: a size that is not a positive int; a micro-batch larger than the loaded batch (or, with
            ``even_micro_batches``, not dividing it); a ``micro_batches`` count that does not divide the loaded batch; a
            global batch that is not a positive multiple of
            ``loaded x data_parallel_size``; an accumulation that contradicts the global batch.

    Example::

        >>> make_batch_plan(64, 32, 1, micro_batch_size=8).describe()
        'global batch 64 = 32 loaded x 2 accumulation x 1 data-parallel rank, each loaded batch as 4 micro-batches of 8'
    """
    loaded = _positive(owner, "loaded_batch_size", loaded_batch_size)
    ranks = _positive(owner, "data_parallel_size", data_parallel_size)
    user_accumulation = _positive(owner, "accumulate_grad_batches", accumulate_grad_batches)
    if micro_batches is not None:
        micro_batch_size = _micro_of_count(owner, _positive(owner, "micro_batches", micro_batches), loaded)
    micro = loaded if micro_batch_size is None else _positive(owner, "micro_batch_size", micro_batch_size)
    _check_micro(owner, micro, loaded, even_micro_batches)
    if global_batch_size is None:
        global_size, accumulation = loaded * user_accumulation * ranks, user_accumulation
    else:
        global_size = _positive(owner, "global_batch_size", global_batch_size)
        accumulation = _accumulation(owner, global_size, loaded, ranks, accumulates)
        if user_accumulation not in (1, accumulation):
            raise ValueError(
                f"{owner}(global_batch_size={global_size}) gives accumulate_grad_batches={accumulation}, not"
                f" Trainer(accumulate_grad_batches={user_accumulation}). Fix: drop one of them."
            )
    return BatchPlan(global_size, loaded, micro, -(-loaded // micro), accumulation, ranks)


def _positive(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}. Fix: pass a whole number >= 1.")
    return value


def _check_micro(owner: str, micro: int, loaded: int, even: bool) -> None:
    if micro > loaded:
        raise ValueError(
            f"{owner}(micro_batch_size={micro}) is larger than the train dataloader's batch_size={loaded}, which it"
            f" splits. Fix: micro_batch_size={loaded} or less, or a larger loader batch_size."
        )
    if even and loaded % micro:
        choices = " or ".join(map(str, nearest_divisors(loaded, micro)))
        raise ValueError(
            f"{owner}(micro_batch_size={micro}) does not divide the loaded batch of {loaded} into equal micro-batches."
            f" Fix: micro_batch_size={choices}."
        )


def _micro_of_count(owner: str, count: int, loaded: int) -> int:
    if loaded % count:
        choices = " or ".join(map(str, nearest_divisors(loaded, count)))
        raise ValueError(
            f"{owner}: a loaded batch of {loaded} samples does not split into {count} equal micro-batches. Fix:"
            f" {choices} micro-batches per loaded batch, or a loader batch_size that is a multiple of {count}."
        )
    return loaded // count


def no_accumulation(owner: str, what: str, fix: str) -> str:
    """The refusal of an accumulation ``what`` under a pipeline (the strategies', and the planner's for its rows)."""
    return (
        f"{owner}: {what}; under a pipeline one optimizer step is one pass over one loaded batch, so there is no"
        f" accumulation. Fix: {fix}."
    )


def _accumulation(owner: str, global_size: int, loaded: int, ranks: int, accumulates: bool) -> int:
    step = loaded * ranks
    if global_size % step == 0 and (accumulates or global_size == step):
        return global_size // step
    if not accumulates:  # the nearest multiples would need an accumulation too: name the sizes that make it in one
        loader = f", or a train dataloader batch_size of {global_size // ranks}" if global_size % ranks == 0 else ""
        what = f"global_batch_size={global_size} with loaded batches of {loaded} x {ranks} data-parallel rank(s)"
        raise ValueError(no_accumulation(owner, what, f"global_batch_size={step}{loader}"))
    globals_ = " or ".join(
        f"{g} ({g // step} accumulation step{'s' if g // step > 1 else ''})"
        for g in nearest_global_batch_sizes(global_size, loaded, ranks)
    )
    if global_size % ranks:
        loaded_fix = f"; no loader batch_size works, since {global_size} is not a multiple of {ranks} ranks"
    else:
        sizes = " or ".join(map(str, nearest_divisors(global_size // ranks, loaded)))
        loaded_fix = f", or a train dataloader batch_size of {sizes}"
    reason = f"smaller than one loaded batch per rank ({step})" if global_size < step else f"not a multiple of {step}"
    raise ValueError(
        f"{owner}(global_batch_size={global_size}) cannot be split into loaded batches of {loaded} x {ranks}"
        f" data-parallel rank{'s' if ranks > 1 else ''} x a whole accumulation: it is {reason}."
        f" Fix: global_batch_size={globals_}{loaded_fix}."
    )


def loaded_batch_size_of(dataloaders: Any) -> int | None:
    """The per-rank batch size of the train dataloader(s), or ``None`` when it cannot be read.

    Reads ``batch_size``, else ``batch_sampler.batch_size``. For a collection of loaders (Lightning's
    ``CombinedLoader`` iterables) the sizes must agree.
    """
    if isinstance(dataloaders, dict):
        loaders: Iterable[Any] = dataloaders.values()
    elif isinstance(dataloaders, (list, tuple)):
        loaders = dataloaders
    else:
        loaders = [dataloaders]
    sizes = set()
    for loader in loaders:
        size = getattr(loader, "batch_size", None)
        if size is None:
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            return None
        sizes.add(size)
    return sizes.pop() if len(sizes) == 1 else None
