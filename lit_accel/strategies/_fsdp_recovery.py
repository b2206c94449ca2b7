"""``CollectiveLedger``: FSDP's collectives kept in step on every rank when one rank runs out of memory mid-attempt.

FSDP2 all-gathers and reduce-scatters inside forward and backward, so a rank whose attempt fails part-way has made
fewer collectives than its peers, who then wait in the next one. Under ``micro_batch_size="auto"`` every FSDP
collective of an attempt (the forwards and backwards of one loaded batch) passes through the ledger, by FSDP's
custom-comm hooks:

- guarded: an attempt with a number of micro-batches not seen succeed before (the first step, the step after a
  change). Before each collective one 1-element all-reduce asks whether a rank has failed. The failed rank answers it
  with its agreement all-reduce; the others raise :class:`PeerOutOfMemory` there. All stop at the same collective.
  The sequence of collectives of a guarded attempt that succeeded everywhere is kept.
- recorded: every later attempt. No extra collective; a rank that fails makes the rest of the kept sequence with
  zero-filled buffers, so its peers finish the attempt, and then every rank agrees with the step's one all-reduce.

Either way every interrupted rank then resets FSDP's iteration state (``FSDPModule.reset_iter_state``) and drops the
partial gradients, every rank discards the attempt, and it is redone with half the micro-batch. The kept sequence is
valid because FSDP issues the same collectives in the same order on every rank and in every attempt with the same number
of micro-batches (the batch size changes the activations, never the parameter groups gathered or reduced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit_accel.strategies._micro_batches import PeerOutOfMemory, any_rank, is_out_of_memory
from lit_accel.utilities._compat import fsdp_drop_unsharded_grads

__all__ = ["CollectiveLedger"]


@dataclass(frozen=True)
class _Collective:
    """One FSDP collective as issued: which comm object, and the buffers' shapes and dtypes (their data is not kept)."""

    comm: Any
    output: tuple[torch.Size, torch.dtype, torch.device]
    input: tuple[torch.Size, torch.dtype, torch.device]
    group: Any
    op: Any  # the reduce-scatter's reduction; None for an all-gather


def _spec(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


class CollectiveLedger:
    """Guard, record and replay the FSDP collectives of ``micro_batch_size="auto"`` attempts (module docstring).

    Args:
        owner: the strategy's class name, for messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.roots: list[Any] = []  # the root FSDP modules, whose iteration state a failed attempt resets
        #: Each failure this rank recovered from: (``"guarded"`` or ``"recorded"``, collectives it made for its peers).
        self.recoveries: list[tuple[str, int]] = []
        self._kept: dict[int, list[_Collective]] = {}  # micro-batches per attempt -> its collectives, in order
        self._key: int | None = None  # the running attempt's micro-batch count; None: no attempt running
        self._device = torch.device("cpu")
        self._seen: list[_Collective] = []
        self._issued = 0
        self._stale = False  # a recorded attempt whose collectives differ from the kept ones
        self._gloo: dict[Any, bool] = {}  # process group -> whether its backend is gloo

    def attach(self, roots: list[Any]) -> None:
        """A fit's sharded model (its root FSDP modules); what was recorded for another model is dropped."""
        self.roots, self._kept = roots, {}

    @property
    def guarded(self) -> bool:
        """Whether the running attempt checks for a failed rank before each collective."""
        return self._key is not None and self._key not in self._kept

    def begin(self, micro_batches: int, device: torch.device) -> None:
        """An attempt of ``micro_batches`` forwards and backwards starts; its collectives go through :meth:`before`."""
        self._key, self._device = micro_batches, device
        self._seen, self._issued, self._stale = [], 0, False

    def before(self, comm: Any, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any = None) -> None:
        """Called by the counting comms right before each collective, its buffers allocated.

        Raises:
            PeerOutOfMemory: (guarded attempts) another rank failed; every rank stops here.
        """
        if self._key is None:
            return
        if output.device.type == "cpu" and self._is_gloo(group):
            # gloo takes the collective's tag and only then allocates its own buffers (a flat copy of the all-gather's
            # output, a clone of the reduce-scatter's input and its all-reduce's scratch), so a failure there leaves
            # the peers waiting on a tag nobody can complete. Allocating as much here first moves that failure out of
            # the call, to where the guard or the replay recovers it.
            size = output.numel() * output.element_size() if op is None else 2 * input.numel() * input.element_size()
            torch.empty(size, dtype=torch.uint8)  # freed at once: the call's own allocation gets the space back
        if self.guarded:
            if any_rank(False, self._device):  # the failed rank's agreement all-reduce answers this one
                raise PeerOutOfMemory(f"{self.owner}: another rank ran out of memory in this attempt.")
            self._seen.append(_Collective(comm, _spec(output), _spec(input), group, op))
        else:  # a model whose collectives changed (layers frozen or unfrozen, a branch unused) re-records
            kept = self._kept[self._key]
            expected = kept[self._issued] if self._issued < len(kept) else None
            if expected is None or expected.comm is not comm or expected.input != _spec(input):
                self._stale = True

    def _is_gloo(self, group: Any) -> bool:
        if group not in self._gloo:
            self._gloo[group] = dist.get_backend(group) == "gloo"
        return self._gloo[group]

    def after(self) -> None:
        """Called when the collective's call returned: issued (a call that failed allocating inside is not)."""
        if self._key is not None:
            self._issued += 1

    def finish(self, succeeded: bool) -> None:
        """The attempt is over (``succeeded``: on every rank); a guarded one that succeeded keeps its sequence."""
        key = self._key
        if key is not None and succeeded and self.guarded:
            self._kept[key] = self._seen
        elif key is not None and succeeded and (self._stale or self._issued != len(self._kept[key])):
            del self._kept[key]  # the next attempt of this size is guarded again and records what happens now
        self._key, self._seen = None, []

    def reset(self) -> None:
        """After a failed attempt: FSDP's iteration state back to idle, sharded, with no partial gradient left."""
        for root in self.roots:
            root.reset_iter_state()
            fsdp_drop_unsharded_grads(root)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()  # the replay below allocates whole gathered buffers

    def complete_for_peers(self) -> None:
        """On the rank that failed: make, with zero-filled buffers, the collectives its peers make before they agree.

        That is the collective whose call failed inside (gloo allocates there), if any, and in a recorded attempt the
        rest of the kept sequence; in a guarded one the peers then wait in a guard, which the agreement answers.
        """
        key, issued, seen = self._key, self._issued, self._seen
        self._key = None  # the replayed collectives pass through ``before`` untouched
        if key is None:
            return
        if key in self._kept and self._stale:
            raise RuntimeError(
                f"{self.owner}(micro_batch_size='auto'): out of memory in an attempt whose FSDP collectives differ"
                " from the recorded ones (parameters frozen or unfrozen, a branch unused?), so the other ranks"
                " cannot be kept in step. Fix: an int micro_batch_size for this model."
            )
        rest = self._kept[key][issued:] if key in self._kept else seen[issued:]
        self.recoveries.append(("recorded" if key in self._kept else "guarded", len(rest)))
        try:
            for call in rest:
                output = torch.empty(call.output[0], dtype=call.output[1], device=call.output[2])
                input = torch.zeros(call.input[0], dtype=call.input[1], device=call.input[2])
                if call.op is None:
                    call.comm(output, input, call.group, async_op=False)
                else:
                    call.comm(output, input, call.group, call.op, async_op=False)
                del output, input
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            raise RuntimeError(
                f"{self.owner}(micro_batch_size='auto'): out of memory again while making the {len(rest)} FSDP"
                " collectives the other ranks wait in, so this job cannot recover (its peers stop with it). Fix: an"
                " int micro_batch_size that leaves room for one gathered FSDP unit, or more memory per device."
            ) from err
