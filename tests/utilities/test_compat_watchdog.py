"""The torch internals HangWatchdog's side channel relies on, through ``lit_accel.utilities._compat``.

``default_process_group_store`` reads torch's private ``distributed_c10d._get_default_store``; the channel then unwraps
the ``PrefixStore``s (``underlying_store``) down to the ``TCPStore`` and opens its own client to its ``host``/``port``.
These tests fail loudly when torch moves any of that.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

from lit_accel.callbacks._hang_channels import open_store_client
from lit_accel.utilities._compat import default_process_group_store
from tests.helpers import run_distributed


def test_torch_still_has_the_private_default_store_getter():
    assert callable(getattr(distributed_c10d, "_get_default_store", None)), (
        "torch.distributed.distributed_c10d._get_default_store is gone: update default_process_group_store"
    )


def test_no_store_without_a_process_group():
    assert not dist.is_initialized()
    assert default_process_group_store() is None


def _through_the_store(rank: int, world_size: int) -> dict[str, object]:
    store = default_process_group_store()
    chain = [type(store).__name__]
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
        chain.append(type(inner).__name__)
    client = open_store_client(store, timeout_s=10.0)  # a connection of its own, as the watchdog thread uses
    client.set(f"lit_accel_test/{rank}", f"hello from {rank}")
    dist.barrier()
    peer = client.get(f"lit_accel_test/{1 - rank}").decode()
    # The prefixed default store and the raw client see different namespaces: the channel's keys never collide
    # with the process group's own.
    return {"chain": chain, "peer": peer, "own_client": client is not store, "host": (inner.host, inner.port)}


def test_default_store_is_reachable_from_a_second_client_on_every_rank():
    results = run_distributed(_through_the_store, 2, timeout=60)
    for rank, result in enumerate(results):
        assert result["chain"][0] == "PrefixStore" and result["chain"][-1] == "TCPStore"
        assert result["own_client"] and result["peer"] == f"hello from {1 - rank}"
    assert results[0]["host"] == results[1]["host"]  # one server (rank 0's), reached by both
