"""The torch internals the hang watchdog relies on, through ``lit_accel.utilities._compat``.

``default_process_group_store`` reads torch's private ``distributed_c10d._get_default_store``; the watchdog thread then
uses it (under a ``PrefixStore`` of its own) while the main thread is blocked in a collective. These tests fail loudly
when torch moves any of that.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lit_accel.utilities._compat import default_process_group_store
from tests.helpers import run_distributed


def test_torch_still_has_the_private_default_store_getter():
    assert callable(getattr(distributed_c10d, "_get_default_store", None)), (
        "torch.distributed.distributed_c10d._get_default_store is gone: update default_process_group_store"
    )


def test_no_store_without_a_process_group():
    assert not dist.is_initialized()
    assert default_process_group_store() is None


def _through_the_store_while_blocked(rank: int, world_size: int) -> dict[str, object]:
    """Rank 1 blocks in an all_reduce for 2 s; meanwhile a thread on each rank uses the store as the watchdog does."""
    store = dist.PrefixStore("lit_accel_test/", default_process_group_store())
    seen: dict[str, object] = {}

    def side_channel() -> None:
        started = time.monotonic()
        store.set(f"state/{rank}", f"hello from {rank}")
        store.add("count", 1)
        while int(store.add("count", 0)) < world_size:
            time.sleep(0.05)
        keys = [f"state/{r}" for r in range(world_size)]
        seen["check"] = store.check(keys) and not store.check(["state/absent"])
        seen["values"] = [v.decode() for v in store.multi_get(keys)]
        seen["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=side_channel)
    thread.start()
    if rank == 1:
        time.sleep(2.0)
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here for 2 s
    thread.join()
    return seen


def test_default_store_answers_a_thread_while_the_main_thread_is_blocked_in_a_collective():
    for result in run_distributed(_through_the_store_while_blocked, 2, timeout=60):
        assert result["check"] and result["values"] == ["hello from 0", "hello from 1"]
        assert result["seconds"] < 1.5  # rank 0's thread did not wait for its main thread's collective
