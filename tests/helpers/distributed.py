"""Run a function in N real processes joined by a gloo process group, with a hard timeout.

This is the harness for every distributed test: no mocks of ``torch.distributed``. Each rank gets the environment a
launcher such as ``torchrun`` would give it (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``NODE_RANK``), so a Lightning ``Trainer(accelerator="cpu", devices=N, strategy=...)`` built inside
the function treats the processes as externally launched and joins the existing group instead of spawning more.

Ranks are forked by default (children inherit the imported torch and Lightning, so a 2-process test starts in well
under a second); ``start_method="spawn"`` is available for functions that must not inherit the parent's state, in
which case ``fn`` must be importable (defined at module level).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]


class DistributedTestError(AssertionError):
    """A rank raised, died, or the group did not finish within the timeout."""


def find_free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: Any,
    timeout: float,
    init_process_group: bool,
) -> None:
    status = 0
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            LOCAL_WORLD_SIZE=str(world_size),
        )
        import torch
        import torch.distributed as dist

        # One intra-op thread per rank: the CI machine has 2 cores, and a forked child must not reuse the
        # parent's OpenMP pool (libgomp is not fork-safe).
        torch.set_num_threads(1)
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=max(timeout, 30.0))
            )
        result = fn(rank, world_size, *args, **kwargs)
        payload = pickle.dumps(("ok", result))
        if init_process_group and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # every failure, KeyboardInterrupt included, must reach the parent
        status = 1
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        # Never run the parent's atexit handlers (pytest's) in a forked child.
        os._exit(status)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    start_method: str = "fork",
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes and return each rank's result.

    Args:
        fn: the function to run on every rank. Its return value must be picklable (tensors are fine).
        world_size: number of processes.
        *args: extra positional arguments for ``fn``.
        timeout: hard limit in seconds for the whole group. When it passes, every rank is killed and the test
            fails, so a hung collective cannot hang CI.
        start_method: ``"fork"`` (fast, default) or ``"spawn"`` (``fn`` must be importable).
        init_process_group: initialise the default gloo group before calling ``fn``. Set to ``False`` when ``fn``
            builds a Lightning ``Trainer`` that should initialise it itself.
        **kwargs: extra keyword arguments for ``fn``.

    Returns:
        The results ordered by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died without reporting, or the
            group did not finish within ``timeout``.

    Example::

        def _sum(rank, world_size):
            t = torch.tensor([rank + 1.0])
            torch.distributed.all_reduce(t)
            return t.item()

        assert run_distributed(_sum, 2) == [3.0, 3.0]
    """
    ctx = mp.get_context(start_method)
    port = find_free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, kwargs, child_conn, timeout, init_process_group),
            daemon=False,
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline, settle = time.monotonic() + timeout, float("inf")
    try:
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                running = [r for r in range(world_size) if r not in results and r not in errors]
                raise DistributedTestError(
                    f"distributed test did not finish within {timeout:.0f}s; ranks still running: {running}"
                    + _format_errors(errors)
                )
            for rank, conn in enumerate(conns):
                if rank in results or rank in errors:
                    continue
                if conn.poll(0.05):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        errors[rank] = _died(rank, procs[rank])
                        continue
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
                elif not procs[rank].is_alive() and not conn.poll(0):
                    errors[rank] = _died(rank, procs[rank])
            if errors:
                # One failed rank leaves its peers blocked in a collective: stop them soon, not at the collective
                # timeout. A second first: a rank that reported first may be the consequence of one dying just now.
                settle = min(settle, time.monotonic() + _SETTLE_S)
                if time.monotonic() > settle:
                    break
        if errors:
            raise DistributedTestError(_format_errors(errors))
    finally:
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
    return [results[r] for r in range(world_size)]


_SETTLE_S = 1.0  # after a failure, how long its peers may take to report theirs (a gloo peer fails within a second)
# A rank whose collective failed because a peer stopped says so; the peer's own failure is the cause.
_CONSEQUENCE = ("error is a consequence, not the cause", "Connection reset by peer", "Connection closed by peer")


def _died(rank: int, proc: Any) -> str:
    proc.join(timeout=1.0)
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        if code == -signal.SIGKILL:
            how += " (with no timeout passed here, usually the out-of-memory killer: see dmesg)"
    else:
        how = f"exited with code {code}"
    return f"rank {rank} {how} without reporting (a crash prints its threads' stacks in pytest's 'Captured stderr')"


def _format_errors(errors: dict[int, str]) -> str:
    """Every failed rank's message, the consequences of a peer's exit first: the cause ends the message, in view."""
    order = sorted(errors, key=lambda rank: (not any(mark in errors[rank] for mark in _CONSEQUENCE), rank))
    return "".join(f"\n--- rank {rank} failed ---\n{errors[rank]}" for rank in order)
