"""The global-batch arithmetic shared by lit_accel's strategies, pure Python so it is property-tested without processes.

The rule (Goyal et al., 2017, "Accurate, Large Minibatch SGD", section 2): the global batch is
``micro-batch per device x accumulation steps x devices``, and every micro-batch loss is divided by the number of
accumulation steps so that the accumulated gradient is the mean over the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_accel.strategies.batch_plan import loaded_batch_size_of as micro_batch_size_of

__all__ = [
    "AccumulationPlan",
    "micro_batch_size_of",
    "nearest_global_batch_sizes",
    "nearest_micro_batch_sizes",
    "plan_accumulation",
]


@dataclass(frozen=True)
class AccumulationPlan:
    """How a global batch decomposes: ``global_batch_size = micro_batch_size x accumulation x world_size``."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    accumulate_grad_batches: int

    def describe(self) -> str:
        """The decomposition as one line, e.g. ``global batch 1024 = 32 per device x 8 accumulation x 4 devices``."""
        devices = "device" if self.world_size == 1 else "devices"
        return (
            f"global batch {self.global_batch_size} = {self.micro_batch_size} per device"
            f" x {self.accumulate_grad_batches} accumulation x {self.world_size} {devices}"
        )


def nearest_global_batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int) -> tuple[int, ...]:
    """The valid global batch sizes (multiples of ``micro x world``, at least one) nearest below and above."""
    step = micro_batch_size * world_size
    below = (global_batch_size // step) * step
    above = -(-global_batch_size // step) * step
    return tuple(sorted({size for size in (below, above) if size >= step}))


def nearest_micro_batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int) -> tuple[int, ...]:
    """The per-device micro-batch sizes nearest below and above ``micro_batch_size`` that divide the global batch.

    A micro-batch size ``b`` works when ``global_batch_size`` is a multiple of ``b x world_size``, i.e. when ``b``
    divides ``global_batch_size / world_size``. Empty when the global batch is not a multiple of the world size.
    """
    if global_batch_size % world_size:
        return ()
    per_device = global_batch_size // world_size
    divisors = set()
    for i in range(1, math.isqrt(per_device) + 1):
        if per_device % i == 0:
            divisors.update((i, per_device // i))
    nearest = set()
    below = [d for d in divisors if d <= micro_batch_size]
    above = [d for d in divisors if d >= micro_batch_size]
    if below:
        nearest.add(max(below))
    if above:
        nearest.add(min(above))
    return tuple(sorted(nearest))


def plan_accumulation(
    global_batch_size: int, micro_batch_size: int, world_size: int, *, owner: str = "AccelDDP"
) -> AccumulationPlan:
    """Decompose ``global_batch_size`` into micro-batch x accumulation x world size.

    Args:
        global_batch_size: samples per optimizer step, over all devices.
        micro_batch_size: samples per forward/backward on one device (the train dataloader's batch size).
        world_size: number of processes (devices x nodes).
        owner: the class named in error messages.

    Returns:
        The plan, with ``accumulate_grad_batches = global_batch_size / (micro_batch_size x world_size)``.

    Raises:
        ValueError: a size is not a positive integer, or the global batch is not a positive multiple of
            ``micro_batch_size x world_size``. The message names the three sizes and the nearest valid choices.

    Example::

        >>> plan_accumulation(1024, 32, 4).describe()
        'global batch 1024 = 32 per device x 8 accumulation x 4 devices'
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}.")
    step = micro_batch_size * world_size
    if global_batch_size % step == 0:
        return AccumulationPlan(global_batch_size, micro_batch_size, world_size, global_batch_size // step)

    globals_ = " or ".join(
        f"{g} ({g // step} accumulation step{'s' if g // step > 1 else ''})"
        for g in nearest_global_batch_sizes(global_batch_size, micro_batch_size, world_size)
    )
    micros = nearest_micro_batch_sizes(global_batch_size, micro_batch_size, world_size)
    if micros:
        micro_fix = (
            f" or a per-device micro-batch size (the train dataloader's batch_size) of "
            f"{' or '.join(str(m) for m in micros)}"
        )
    else:
        micro_fix = (
            f"; no per-device micro-batch size works, because {global_batch_size} is not a multiple of the"
            f" world size {world_size}"
        )
    reason = (
        f"it is smaller than one micro-batch on every device ({step})"
        if global_batch_size < step
        else f"it is not a multiple of {step}"
    )
    raise ValueError(
        f"{owner}(global_batch_size={global_batch_size}) cannot be split into {micro_batch_size} samples per device"
        f" x {world_size} device{'s' if world_size > 1 else ''} x a whole number of accumulation steps: {reason}."
        f" Fix: use global_batch_size={globals_}{micro_fix}."
    )
