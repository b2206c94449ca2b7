"""The pipeline bubble, measured and analytic: each rank's busy time inside the schedule's actions against its wall.

Measured: the wall of every ``schedule.step()`` and, inside it, the time in the stage's compute actions (forward,
full backward, input-gradient and weight-gradient halves), host clock on CPU and CUDA events on GPU, resolved at
logging steps only. ``bubble = 1 - busy / wall`` per rank.

Analytic: the same schedule's action order replayed with every action taking this window's mean duration of its kind
on this rank (all stages alike, no communication time): an action starts when its rank is free and its inputs are done
(the forward of the previous stage, the backward of the next). For GPipe and 1F1B with equal forward and backward
times rank 0's value is the textbook ``(p - 1) / (m + p - 1)``; the zero-bubble schedules fill part of it with weight
gradients. The difference to the measured value is what communication and imbalance cost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from lit_accel.protocols import PipelineBubble
from lit_accel.utilities._timing import IntervalTimer

__all__ = ["KINDS", "BubbleMeter", "Order", "simulate", "single_stage_order", "torch_order"]

KINDS = ("F", "B", "I", "W")
#: Per pipeline rank, its compute actions in order: ``(stage, kind, micro-batch)``.
Order = dict[int, list[tuple[int, str, int]]]


def single_stage_order(schedule: str, pipeline: int, microbatches: int) -> Order:
    """The action order of GPipe (all forwards, then all backwards) or 1F1B (warm-up forwards, then alternate)."""
    order: Order = {}
    for rank in range(pipeline):
        forwards = [(rank, "F", mb) for mb in range(microbatches)]
        backwards = [(rank, "B", mb) for mb in range(microbatches)]
        if schedule == "gpipe":
            order[rank] = forwards + backwards
            continue
        warmup = min(pipeline - 1 - rank, microbatches)
        steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
        order[rank] = forwards[:warmup] + steady + backwards[microbatches - warmup :]
    return order


def torch_order(pipeline_order: dict[int, list[Any]]) -> Order:
    """A torch schedule's ``pipeline_order`` (compute actions, ``None`` for idle) as an :data:`Order`."""
    order: Order = {}
    for rank, actions in pipeline_order.items():
        flat: list[tuple[int, str, int]] = []
        for action in actions:
            for sub in _expand(action):
                kind = str(getattr(sub.computation_type, "value", sub.computation_type))
                if kind in KINDS and sub.microbatch_index is not None:
                    flat.append((sub.stage_index, kind, sub.microbatch_index))
        order[rank] = flat
    return order


def _expand(action: Any) -> Iterable[Any]:
    if action is None:
        return ()
    subs = getattr(action, "sub_actions", None)
    return subs if subs else (action,)


def _ready(action: tuple[int, str, int], done: dict[tuple[int, str, int], float], last_stage: int) -> float | None:
    """When the inputs of ``action`` are done (``None``: not yet)."""
    stage, kind, mb = action
    needs: list[tuple[int, str, int]] = []
    if kind == "F" and stage > 0:
        needs.append((stage - 1, "F", mb))
    elif kind in ("B", "I"):
        needs.append((stage, "F", mb))
        if stage < last_stage:
            later = (stage + 1, "B", mb) if (stage + 1, "B", mb) in done else (stage + 1, "I", mb)
            needs.append(later)
    elif kind == "W":
        needs.append((stage, "I", mb))
    times = [done.get(need) for need in needs]
    return None if any(t is None for t in times) else max([0.0, *times])  # type: ignore[type-var]


def simulate(order: Order, durations: dict[str, float], num_stages: int) -> dict[int, tuple[float, float]]:
    """``rank -> (busy, finish)`` of the ideal run of ``order`` with the given duration per action kind."""
    done: dict[tuple[int, str, int], float] = {}
    position = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                ready = _ready(action, done, num_stages - 1)
                if ready is None:
                    break
                cost = durations.get(action[1], 0.0)
                done[action] = max(free[rank], ready) + cost
                free[rank], busy[rank] = done[action], busy[rank] + cost
                position[rank] += 1
                progressed = True
    return {rank: (busy[rank], free[rank]) for rank in order}


class BubbleMeter:
    """One rank's busy and wall time in the pipeline, and the analytic idle time of the same steps."""

    def __init__(self, device: torch.device, rank: int, num_stages: int) -> None:
        self.rank, self.num_stages = rank, num_stages
        self._timers = {kind: IntervalTimer(device, time.perf_counter) for kind in KINDS}
        self._counts = dict.fromkeys(KINDS, 0)
        self._wall = IntervalTimer(device, time.perf_counter)
        self._steps: dict[int, int] = {}  # id(order) -> steps run with it since the last pop
        self._orders: dict[int, Order] = {}

    def action_start(self, kind: str) -> None:
        """A compute action of ``kind`` (``F``, ``B``, ``I`` or ``W``) begins on this rank."""
        self._timers[kind].start()

    def action_end(self, kind: str) -> None:
        """It ended."""
        self._timers[kind].stop()
        self._counts[kind] += 1

    def step_start(self, order: Order) -> None:
        """A ``schedule.step()`` with this action order begins."""
        self._wall.start()
        self._orders[id(order)] = order
        self._steps[id(order)] = self._steps.get(id(order), 0) + 1

    def step_end(self) -> None:
        """It returned."""
        self._wall.stop()

    def pop(self) -> PipelineBubble:
        """Busy, wall and analytic idle seconds since the last pop (resolve device events: logging steps only)."""
        totals = {kind: timer.pop_total_s() for kind, timer in self._timers.items()}
        means = {kind: totals[kind] / self._counts[kind] for kind in KINDS if self._counts[kind]}
        wall = self._wall.pop_total_s()
        analytic_wall = analytic_busy = 0.0
        for key, steps in self._steps.items():
            busy, finish = simulate(self._orders[key], means, self.num_stages).get(self.rank, (0.0, 0.0))
            analytic_busy, analytic_wall = analytic_busy + steps * busy, analytic_wall + steps * finish
        idle_share = 1.0 - analytic_busy / analytic_wall if analytic_wall > 0 else 0.0
        self._counts = dict.fromkeys(KINDS, 0)
        self._steps.clear()
        return PipelineBubble(sum(totals.values()), wall, idle_share * wall)
