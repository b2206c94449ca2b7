"""``BucketRounds``: AccelDDP's all-reduces counted without a comm hook, while nobody times them.

A Python comm hook costs the host tens of microseconds per bucket (``benchmarks/host_cost.py``). So AccelDDP lets
DDP's own C++ all-reduce run unless a consumer asks for timing (``HookCommStats.request_timing``), and counts by the
hook's rule: one round per synchronised backward, in which DDP all-reduces every bucket of its layout once.

* A round is a backward for which the reducer was prepared: DDP's forward (or Lightning's ``prepare_for_backward`` in
  manual optimization) sets ``require_forward_param_sync`` exactly then. AccelDDP counts it after the backward.
* The layout is the one DDP built at construction until its one rebuild (in gradient-ready order), which happens
  before the round after the first round that recorded that order: round 2; round 3 with ``static_graph`` (its
  first iteration records nothing); never with ``find_unused_parameters`` (without ``static_graph``).
* Sizes come from DDP's logging data, read when the counters are read (logging steps): the construction layout at
  once, the rebuilt one from the synchronised forward after the rebuild on. A read before that (only a reader at the
  rebuild's own step) takes it from the reducer's buckets, which allocates a zeroed copy of the gradients, once.
* Time is estimated from the rounds DDP's reducer times itself (in C++, every ``sample_rate``-th synchronised
  iteration; AccelDDP sets the rate to the Trainer's ``log_every_n_steps``): the rounds since the previous pop, each
  as long as the latest sampled one. A round's communication lasts from its first bucket's launch to the end of
  ``finalize_backward``; its exposed part is that minus its overlap with the backward's compute (from the launch to
  the end of the compute): the time from the end of the compute to the last bucket's completion, as the hook measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_accel.utilities._compat import ddp_bucket_sizes, ddp_sampled_round

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["BucketRounds"]


class BucketRounds:
    """The synchronised backward passes of one DDP model and the bucket layout each reduced, resolved lazily.

    The owner counts the rounds (one integer per backward, ``HookCommStats.rounds``) and passes its count when it
    reads: which layout each round used follows from its number.

    Args:
        ddp: the wrapped model, before its first backward.
        rounds: the owner's round count now (this model's first round is the next one).
    """

    def __init__(self, ddp: DistributedDataParallel, rounds: int = 0) -> None:
        self._ddp: DistributedDataParallel | None = ddp
        initial = ddp_bucket_sizes(ddp, rebuilt=False)
        assert initial is not None  # set at construction
        self._sizes: list[tuple[int, ...] | None] = [initial, None]
        rebuilds = ddp.static_graph or not ddp.find_unused_parameters
        self._rebuild_round = (3 if ddp.static_graph else 2) if rebuilds else None
        self._start = self._folded = rounds  # the owner's count at this model's start, and at the last fold
        self._popped = [rounds, rounds]  # the owner's count at the previous pop of the elapsed and of the exposed time

    def pending(self, rounds: int) -> bool:
        """Whether rounds are not folded yet (``rounds``: the owner's count)."""
        return rounds > self._folded

    def _unfolded(self, rounds: int) -> tuple[int, int]:
        """The rounds not folded yet, with the construction layout and with the rebuilt one."""
        before = rounds if self._rebuild_round is None else min(rounds, self._start + self._rebuild_round - 1)
        initial = max(0, before - self._folded)
        return initial, rounds - self._folded - initial

    def fold(self, rounds: int) -> tuple[int, int]:
        """``(calls, bytes)`` of the pending rounds, which are forgotten."""
        calls = nbytes = 0
        for layout, count in enumerate(self._unfolded(rounds)):
            if count:
                sizes = self._layout(layout)
                calls, nbytes = calls + count * len(sizes), nbytes + count * sum(sizes)
        self._folded = rounds
        return calls, nbytes

    def pop_sampled_s(self, rounds: int, exposed: bool = False) -> float:
        """Seconds of communication (``exposed``: of it not hidden by the backward) in the rounds since the last pop.

        Estimated from DDP's latest sampled round (0.0 before its first sample, or once the model is released). Reads
        DDP's logging data: call it at logging steps only.
        """
        count, self._popped[exposed] = rounds - self._popped[exposed], rounds
        sample = ddp_sampled_round(self._ddp) if count and self._ddp is not None else None
        if sample is None:
            return 0.0
        _, comm_s, overlap_s = sample
        return count * (max(0.0, comm_s - overlap_s) if exposed else comm_s)

    def release(self, rounds: int) -> tuple[int, int]:
        """Fold the pending rounds and drop the model (the fit ends, or a comm hook counts from now on)."""
        folded = self.fold(rounds)
        self._ddp = None
        return folded

    def _layout(self, layout: int) -> tuple[int, ...]:
        sizes = self._sizes[layout]
        if sizes is None:
            assert self._ddp is not None  # rounds with the rebuilt layout are folded before the model is dropped
            sizes = self._sizes[layout] = ddp_bucket_sizes(self._ddp, rebuilt=True)
        assert sizes is not None
        return sizes
