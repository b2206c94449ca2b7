"""torch APIs newer than lit_accel's floor (``pyproject.toml``), each with its version gate and the fallback below it.

The gate is a feature test (``hasattr``), not a version comparison, so a backport or a nightly works too; the version
named beside each gate is the first release that has the API, and ``tests/utilities/test_torch_fallbacks.py`` fails
when a torch release disagrees, so a fallback is deleted once the floor passes its version. Both branches of every
fallback run in the tests, whichever torch is installed.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["HAS_SINGLE_COLLECTIVES", "all_gather_single", "reduce_scatter_single"]

#: torch >= 2.13: ``dist.all_gather_single`` / ``dist.reduce_scatter_single``; torch 2.14 deprecates the older
#: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same collectives, same arguments) in their favour.
HAS_SINGLE_COLLECTIVES = hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def all_gather_single(
    output: Any, input: Any, group: Any = None, async_op: bool = False, *, native: bool = True
) -> Any:
    """Gather every rank's ``input`` into ``output`` in rank order; the work handle when ``async_op``.

    ``native=False`` takes the fallback even where torch has the new API (the tests run both).
    """
    if native and HAS_SINGLE_COLLECTIVES:
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: Any, input: Any, op: Any = None, group: Any = None, async_op: bool = False, *, native: bool = True
) -> Any:
    """Reduce ``input`` (world size x ``output``) over the group with ``op`` (None: sum); keep this rank's chunk."""
    op = dist.ReduceOp.SUM if op is None else op
    if native and HAS_SINGLE_COLLECTIVES:
        return dist.reduce_scatter_single(output=output, input=input, group=group, op=op, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
