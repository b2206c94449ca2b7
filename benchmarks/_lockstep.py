"""Two jobs in one process that take turns, a step each: paired timing under the same machine speed.

A shared 2-core VM changes speed by 20-30 % within seconds (other tenants, stolen slices), so two fits timed one after
the other differ by more than the 0.05 ms a host-cost limit asks to resolve. Run in turns, step ``k`` of one fit and
step ``k`` of the other run within a millisecond of each other; the per-thread CPU time of a block of steps of each is
then a paired measurement (``benchmarks/host_cost.py``). Only one thread runs at a time: the other waits on a
condition, which costs no CPU time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Turns", "run_in_turns"]


class Turns:
    """Whose turn it is among two threads; a thread that finished leaves the turn to the other for good."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def _mine(self, me: int) -> bool:
        return self._turn == me or self._done[1 - me]

    def wait(self, me: int) -> None:
        """Block until it is ``me``'s turn (or the other thread finished)."""
        with self._cond:
            self._cond.wait_for(lambda: self._mine(me))

    def hand_over(self, me: int) -> None:
        """``me`` ends its turn and waits for its next one (at once if the other thread finished)."""
        with self._cond:
            if self._done[1 - me]:
                return
            self._turn = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._mine(me))

    def finish(self, me: int) -> None:
        """``me`` is done: the other thread runs from now on without waiting."""
        with self._cond:
            self._done[me] = True
            self._turn = 1 - me
            self._cond.notify_all()


def run_in_turns(jobs: Sequence[Callable[[Turns, int], Any]]) -> list[Any]:
    """Run two ``job(turns, me)`` in threads, job 0 first; each calls ``turns.hand_over(me)`` once per step.

    Returns their results; re-raises the first job's exception, if any.
    """
    if len(jobs) != 2:
        raise ValueError(f"run_in_turns: {len(jobs)} jobs; it takes turns between exactly 2.")
    turns = Turns()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]

    def body(me: int) -> None:
        turns.wait(me)
        try:
            results[me] = jobs[me](turns, me)
        except BaseException as err:  # handed to the caller's thread below
            errors[me] = err
        finally:
            turns.finish(me)

    threads = [threading.Thread(target=body, args=(me,), name=f"lockstep-{me}") for me in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for err in errors:
        if err is not None:
            raise err
    return results
