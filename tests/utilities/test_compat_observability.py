"""The private torch hooks the EfficiencyMonitor's new figures rely on: fail loudly if torch moves them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_accel.utilities._compat import (
    current_graph_task_id,
    dynamo_compile_counts,
    dynamo_graph_count,
    queue_backward_callback,
)
from lit_accel.utilities._torch_fallbacks import all_gather_single
from tests.helpers import run_distributed


def test_queue_backward_callback_runs_after_the_last_backward_op_and_refuses_outside_a_backward():
    order: list[str] = []
    assert queue_backward_callback(lambda: order.append("never")) is False  # no backward pass running

    class _Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
            ctx.name = name
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            order.append(ctx.name)
            if ctx.name == "last op":  # queued from inside the pass: runs once the whole pass is done
                assert queue_backward_callback(lambda: order.append("callback"))
            return grad, None

    x = torch.randn(3, requires_grad=True)
    _Mark.apply(_Mark.apply(x, "first op") * 2, "last op").sum().backward()
    assert order == ["last op", "first op", "callback"]


def test_current_graph_task_id_tells_one_backward_pass_from_the_next():
    seen: list[int] = []

    class _Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(current_graph_task_id())
            return grad

    x = torch.randn(2, requires_grad=True)
    assert current_graph_task_id() == -1
    _Record.apply(_Record.apply(x)).sum().backward()  # two ops of one pass
    _Record.apply(x).sum().backward()
    assert seen[0] == seen[1] >= 0 and seen[2] > seen[1]


def _callback_before_ddp_finalize(rank: int, world_size: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    events: list[str] = []
    ddp = DistributedDataParallel(nn.Linear(4, 2))

    def hook(state, bucket):  # no annotations: DDP compares them with its own types, and these would be strings
        events.append("hook")
        assert queue_backward_callback(lambda: events.append(f"callback: weight grad {grad()}"))
        work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)  # a sum: a hook's result is not divided
        return work.get_future().then(lambda fut: fut.value()[0])

    def grad() -> float:  # DDP's finalize_backward copies the reduced bucket into .grad
        return float(ddp.module.weight.grad[0, 0])

    ddp.register_comm_hook(None, hook)
    ddp(torch.full((2, 4), rank + 1.0)).sum().backward()  # local weight gradient: 2 (rank + 1) per entry
    events.append(f"after backward: weight grad {grad()}")
    return events


def test_a_callback_queued_from_a_comm_hook_runs_before_ddps_finalize_backward():
    # AccelDDP's HookCommStats marks the end of the backward's compute this way: it must run before DDP waits for the
    # buckets (finalize_backward, also a queued callback, queued when the last bucket is ready).
    # Spawned: a forked child's backward fails ("autograd's threading ... fork") once an earlier test in this pytest
    # process has compiled with torch.compile.
    ranks = run_distributed(_callback_before_ddp_finalize, 2, timeout=180, start_method="spawn")  # slow on busy cores
    for rank, events in enumerate(ranks):
        local, reduced = 2.0 * (rank + 1), 2.0 * (1 + 2)
        assert events == ["hook", f"callback: weight grad {local}", f"after backward: weight grad {reduced}"]


def test_dynamo_compile_counts_count_each_recompilation_of_a_frame():
    def double_plus_one(x: torch.Tensor) -> torch.Tensor:  # a frame no other test compiles
        return x * 2 + 1

    before = dynamo_compile_counts()
    compiled = torch.compile(double_plus_one, backend="eager", dynamic=False)
    for rows in (2, 3, 3, 5):  # three shapes: one compilation, then two recompilations (3 is cached)
        compiled(torch.randn(rows))
    after = dynamo_compile_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (3, 2)


def test_dynamo_graph_count_counts_graphs_and_not_skipped_frames():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).relu()

    class Skipped(Block):
        @torch.compiler.disable
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).relu()

    block, skipped = Block(), Skipped()
    for module in (block, skipped):
        module.forward = torch.compile(module.forward, backend="eager")  # type: ignore[method-assign]
    with torch.no_grad():  # (no autograd in the test process: later tests fork it)
        before = dynamo_graph_count()
        skipped(torch.ones(1, 2))
        assert dynamo_graph_count() == before  # a frame dynamo skips makes no graph
        block(torch.ones(1, 2))
        assert dynamo_graph_count() == before + 1


def _gather_flat(rank: int, world_size: int) -> tuple[list[float], list[str]]:
    import warnings

    output = torch.empty(2 * world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_gather_single(output, torch.tensor([rank, 10.0 + rank]))
    return output.tolist(), [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_all_gather_single_gathers_in_rank_order_without_a_deprecation_warning():
    for gathered, future_warnings in run_distributed(_gather_flat, 2, timeout=60):
        assert gathered == [0.0, 10.0, 1.0, 11.0]
        assert future_warnings == []
