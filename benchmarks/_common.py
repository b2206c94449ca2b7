"""Shared helpers of the lit_accel benchmarks: process launcher, interleaved repetitions, statistics, JSON output.

Every benchmark measures *ratios inside one run*: the arms being compared run in interleaved order (``A B C``, then
``B C A``, then ``C A B``, ...) in the same processes, so that a change of machine load hits every arm alike, and the
ratio of two arms is taken repetition by repetition (paired) before its median is reported. Spreads are reported as
the inter-quartile range and min/max over repetitions, so a reader sees the noise next to the number.

Not a library module: the scripts in this folder import it as ``_common`` (``python benchmarks/<name>.py`` puts
``benchmarks/`` first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import multiprocessing as mp
import os
import pickle
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# Lightning's advice that is irrelevant to a benchmark (synthetic in-memory data needs no loader workers).
QUIET_WARNINGS = (
    ".*does not have many workers.*",
    ".*GPU available but not used.*",
    ".*is an invalid version and will not be supported.*",
    ".*`training_step` returned `None`.*",
    ".*The number of training batches.*is smaller than the logging interval.*",
)


def quiet() -> None:
    """Silence the warnings and info lines that would drown the benchmark's output (not its errors)."""
    import logging

    import lightning.pytorch  # noqa: F401  (its import sets its loggers to INFO: lower them afterwards)

    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.WARNING)


# Trainer arguments every benchmark fit shares: nothing but the timed training steps runs.
QUIET_TRAINER: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


def precision_plugins(precision: str, **kwargs: Any) -> list[Any]:
    """``[AccelPrecision(precision, **kwargs)]``, or no plugin for ``"32-true"`` (full precision is Lightning's own)."""
    from lit_accel import AccelPrecision

    return [] if precision == "32-true" else [AccelPrecision(precision, **kwargs)]  # type: ignore[arg-type]


def classifier(net: Any, make_optimizer: Callable[[Any], Any]) -> Any:
    """A LightningModule training ``net`` (as ``.net``) with cross-entropy and ``make_optimizer(parameters)``."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.parameters())

    return Classifier()


# ---------------------------------------------------------------------------------------------------- arguments


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose description is the script's first docstring paragraph, with ``--out``."""
    first = (doc or name).strip().split("\n\n")[0]
    p = argparse.ArgumentParser(description=first, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / f"{name}.json",
        help="JSON output; a markdown table is written next to it with the suffix .md",
    )
    return p


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


# ---------------------------------------------------------------------------------------------------- machine


def _lscpu_model() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (``uptime``), or None where the OS has none."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def machine_info() -> dict[str, Any]:
    """Machine, software versions, date and load: what RESULTS.md records next to every table."""
    import lightning
    import torch

    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": _lscpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "git_commit": _git_commit(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


# ---------------------------------------------------------------------------------------------------- statistics


def summarize(values: Sequence[float], digits: int = 4) -> dict[str, float]:
    """Median, quartiles, inter-quartile range and min/max of repetition values (``n`` = how many)."""
    if not values:
        raise ValueError("summarize() needs at least one value")
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    out = {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": ordered[0],
        "max": ordered[-1],
    }
    return {**{k: round(v, digits) for k, v in out.items()}, "n": len(ordered)}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Repetition-by-repetition ratios of two interleaved arms (drift that hits both arms in one repetition cancels)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired_ratios: {len(numerator)} vs {len(denominator)} repetitions")
    return [a / b for a, b in zip(numerator, denominator)]


def rotated(arms: Sequence[str], rep: int) -> list[str]:
    """The arms in the order of repetition ``rep``: rotated by one every repetition (A B C, B C A, C A B, ...)."""
    k = rep % len(arms)
    return [*arms[k:], *arms[:k]]


def mean_period(stamps: Sequence[float], warmup: int, steps: int) -> float:
    """Mean time between consecutive step starts, over ``steps`` steps after ``warmup`` steps.

    ``stamps[i]`` is the host clock at the start of step ``i``; ``steps + 1`` stamps after the warm-up are needed.
    A period includes everything the loop does per step (data fetch, hooks, forward, backward, all-reduce,
    optimizer), and periodic work (logging steps) in proportion to its frequency.
    """
    if len(stamps) < warmup + steps + 1:
        raise ValueError(f"mean_period: {len(stamps)} step stamps, need warmup {warmup} + steps {steps} + 1")
    return (stamps[warmup + steps] - stamps[warmup]) / steps


# ---------------------------------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    backend: str,
    args: tuple[Any, ...],
    conn: Any,
) -> None:
    status = 0
    try:
        # What a launcher (torchrun) sets: a Lightning Trainer(devices=world_size) built in ``fn`` then treats the
        # processes as externally launched and joins the group created below instead of starting more processes.
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            # Lightning's DDP launcher sets torch's threads to cores / processes unless this is set: keep ours.
            OMP_NUM_THREADS=str(threads),
        )
        quiet()
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # every failure must reach the parent, which stops the other ranks
        status = 1
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        os._exit(status)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    timeout: float = 3600.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined by ``backend``; return results.

    The processes live for the whole call, so ``fn`` can build several Trainers (and raw loops) one after the
    other in the same process group: the interleaved arms of a benchmark run in identical processes. ``fn`` must be
    importable (defined at module level): processes are started with ``spawn``, so that no thread pool or CUDA
    state is inherited. Each process runs ``threads`` intra-op threads; with ``backend="nccl"`` rank ``r`` uses GPU
    ``r``.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or the group exceeded ``timeout``.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, threads, backend, args, child_conn))
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"benchmark ranks did not finish within {timeout:.0f}s")
            for rank, conn in enumerate(conns):
                if rank in results or not conn.poll(0.1):
                    if rank not in results and not procs[rank].is_alive() and not conn.poll(0):
                        raise RuntimeError(f"rank {rank} died (exit code {procs[rank].exitcode}) without reporting")
                    continue
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError as err:
                    raise RuntimeError(f"rank {rank} exited (code {procs[rank].exitcode}) without reporting") from err
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
    finally:
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
    return [results[r] for r in range(world_size)]


def slowest_rank(values: Sequence[float]) -> list[float]:
    """Element-wise maximum over ranks of a per-repetition list (call inside a process group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class RepeatBatch:
    """An iterable of ``n`` times the same batch (a plain list would be read by Lightning as several loaders).

    Used as a train loader: the data is made once, on the device, so data loading stays out of the measurement."""

    def __init__(self, batch: Any, n: int) -> None:
        self.batch, self.n = batch, n

    def __iter__(self) -> Any:
        return (self.batch for _ in range(self.n))

    def __len__(self) -> int:
        return self.n


# ---------------------------------------------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (a ``|`` inside a cell is escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, as typed from the repository root."""
    rest = list(argv) if argv is not None else sys.argv[1:]
    return " ".join(["python", f"benchmarks/{script}", *rest])


def write_outputs(result: dict[str, Any], out: Path, table: str | None = None) -> None:
    """Write ``result`` as JSON to ``out`` (and ``table`` to ``out`` with suffix ``.md``), then print the JSON."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    out.write_text(text + "\n")
    if table is not None:
        header = f"<!-- written by: {result.get('command', '')} -->\n\n"
        out.with_suffix(".md").write_text(header + table)
        print(table, file=sys.stderr)
    print(text)
