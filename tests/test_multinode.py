"""Two nodes on one machine: two ``torchrun`` agents, ``--nnodes=2 --nproc_per_node=2``, run tests/scripts/multinode.py.

The agents are started with README.md's commands ("Launch on N GPUs, with torchrun, on several nodes"; the static
``--master_addr``/``--master_port`` rendezvous on 127.0.0.1), plus the script's own arguments. One job serves the
default suite: it trains 3 optimizer steps over 4 ranks, every rank dumps its state, then global rank 3 (node 1)
SIGKILLs itself. The dumps must equal a one-process replay (the global batch of 32 over 4 ranks, BatchNorm statistics
synchronised within each node only), and the kill must end both nodes non-zero within seconds, with the dead rank
named and no process left. A clean run to the end is the slow test.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import find_free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "multinode.py"
# README.md runs exactly this on each node (with the port 29500); the test adds the script's arguments.
NODE_COMMAND = (
    "torchrun --nnodes=2 --node_rank={node_rank} --nproc_per_node=2 --master_addr=127.0.0.1 --master_port={port} "
    "tests/scripts/multinode.py"
)
README_PORT = 29500
NODES, PER_NODE, GLOBAL, MICRO = 2, 2, 32, 4
DUMP_STEP = 3  # the kill comes when step 3 (the 4th) begins, right after every rank dumped
LIMIT_S = 120.0  # the whole job: four Lightning processes start on two shared cores first
SHUTDOWN_S = 30.0  # from the kill to the exit of both agents; a hang would last gloo's 30-minute timeout


class _Node(NamedTuple):
    returncode: int
    output: str
    ended_at: float  # wall clock


class _Job(NamedTuple):
    nodes: list[_Node]
    out: Path
    elapsed_s: float
    leftover: list[int]


def _torchrun(node_rank: int, port: int) -> list[str]:
    command = shlex.split(NODE_COMMAND.format(node_rank=node_rank, port=port))
    torchrun = Path(sys.executable).with_name("torchrun")  # the virtualenv's, as `torchrun` resolves after activation
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, *command[1:]]


def _job_processes(marker: str) -> list[int]:
    """PIDs of running (non-zombie) processes whose command line contains ``marker`` (the job's output dir)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z" and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def _run_job(out: Path, script_args: list[str]) -> _Job:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    port, started = find_free_port(), time.monotonic()
    args = ["--output-dir", str(out), *script_args]
    procs = [
        subprocess.Popen([*_torchrun(rank, port), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for rank in range(NODES)
    ]  # fmt: skip
    nodes = []
    try:
        for proc in procs:
            remaining = max(1.0, LIMIT_S - (time.monotonic() - started))
            output, _ = proc.communicate(timeout=remaining)
            nodes.append(_Node(proc.returncode, output, time.time()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the two-node job did not end within {LIMIT_S:.0f} s")
    elapsed = time.monotonic() - started
    leftover = _job_processes(str(out))
    for _ in range(50):  # give a worker that is still exiting a moment
        if not leftover:
            break
        time.sleep(0.1)
        leftover = _job_processes(str(out))
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    return _Job(nodes, out, elapsed, leftover)


def _dumps(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(NODES * PER_NODE)]


def _replay(script: Any, steps: int) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The job in one process: final parameters, and each node's running statistics of the input BatchNorm.

    A non-shuffling sampler over 4 ranks gives rank r the samples r, r+4, ...; micro-batch m of node k's two ranks
    together is what SyncBatchNorm(group_size=2) normalises. In training mode BatchNorm uses the batch's statistics,
    so the gradient is the mean of the two nodes' losses, each over its joint batch, averaged over the accumulation.
    """
    x, y = script.dataset().tensors
    world, accumulation = NODES * PER_NODE, GLOBAL // (MICRO * NODES * PER_NODE)

    def node_batch(node: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [r + world * (MICRO * m + j) for r in (node * PER_NODE, node * PER_NODE + 1) for j in range(MICRO)]
        return x[rows], y[rows]

    pl.seed_everything(0, verbose=False)  # as the script does before building the model
    net = script.InputBNModel(argparse.Namespace(output_dir=None, dump_step=None, kill_rank=None, kill_step=None)).net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    stats = [torch.nn.BatchNorm1d(8) for _ in range(NODES)]
    for step in range(steps):
        for micro in range(accumulation):
            m = step * accumulation + micro
            losses = []
            for node in range(NODES):
                inputs, targets = node_batch(node, m)
                stats[node](inputs)
                losses.append(torch.nn.functional.mse_loss(net(inputs), targets))
            (sum(losses) / NODES / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = {f"net.{name}": p.detach().clone() for name, p in net.named_parameters()}
    return params, [(bn.running_mean, bn.running_var) for bn in stats]


@pytest.fixture(scope="module")
def script() -> Any:
    """tests/scripts/multinode.py imported: its data set, model and kill marker."""
    spec = importlib.util.spec_from_file_location("multinode_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory) -> _Job:
    out = tmp_path_factory.mktemp("multinode_kill")
    return _run_job(out, ["--max-steps", "50", "--dump-step", str(DUMP_STEP), "--kill-rank", "3",
                          "--kill-step", str(DUMP_STEP)])  # fmt: skip


def test_readme_runs_the_commands_this_test_runs():
    readme = re.sub(r"\\\n\s*", "", (REPO / "README.md").read_text())  # join continued lines
    for node_rank in range(NODES):
        assert NODE_COMMAND.format(node_rank=node_rank, port=README_PORT) in readme, node_rank


def _check_training(job: _Job, script: Any, steps: int) -> None:
    dumps = _dumps(job.out)
    for rank, dump in enumerate(dumps):
        assert (dump["global_rank"], dump["node_rank"], dump["local_rank"]) == (rank, rank // 2, rank % 2)
        assert (dump["world_size"], dump["global_step"]) == (NODES * PER_NODE, steps)
        # the global batch holds over 4 ranks: 32 = 4 per device x 4 devices x 2 accumulation
        assert (dump["global_batch_size"], dump["micro_batch_size"], dump["accumulate_grad_batches"]) == (GLOBAL, 4, 2)
        assert dump["sync_bn_group_size"] == PER_NODE
    decomposition = f"AccelDDP: global batch {GLOBAL} = {MICRO} loaded x 2 accumulation x 4 data-parallel ranks"
    assert decomposition in job.nodes[0].output
    params, node_stats = _replay(script, steps)
    for name, value in params.items():
        for dump in dumps:  # DDP keeps the 4 ranks' weights identical, and equal to the one-process replay
            assert torch.equal(dump["params"][name], dumps[0]["params"][name]), name
        torch.testing.assert_close(dumps[0]["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for node, (mean, var) in enumerate(node_stats):
        first, second = dumps[2 * node], dumps[2 * node + 1]
        # group_size=2: the node's two ranks hold the same statistics, those of their joint batches
        assert torch.equal(first["running_mean"], second["running_mean"])
        assert torch.equal(first["running_var"], second["running_var"])
        torch.testing.assert_close(first["running_mean"], mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(first["running_var"], var, rtol=1e-5, atol=1e-5)
    # ... and the nodes do not share theirs (node 1's samples are shifted by +3)
    assert (dumps[2]["running_mean"] - dumps[0]["running_mean"]).abs().min() > 1.0


def test_the_global_batch_and_per_node_batchnorm_groups_hold_on_two_nodes(killed_job, script):
    _check_training(killed_job, script, DUMP_STEP)


def test_killing_a_rank_on_node_one_ends_both_nodes_naming_it(killed_job, script):
    node0, node1 = killed_job.nodes
    assert node0.returncode != 0 and node1.returncode != 0, (node0.output[-3000:], node1.output[-3000:])
    # node 1's agent names the dead rank and the signal; node 0's ranks say their error is a consequence
    assert re.search(r"rank\s*: 3 \(local_rank: 1\)\s*exitcode\s*: -9", node1.output), node1.output[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in node1.output
    assert "another process of the 4-process job stopped" in node0.output, node0.output[-3000:]
    marker = re.search(rf"{script.KILL_MARKER} (\d+\.\d+)", node1.output)
    assert marker, node1.output[-3000:]
    shutdown = max(node.ended_at for node in killed_job.nodes) - float(marker.group(1))
    assert shutdown < SHUTDOWN_S, shutdown
    assert killed_job.elapsed_s < LIMIT_S
    assert not killed_job.leftover, killed_job.leftover


@pytest.mark.slow
def test_a_clean_two_node_run_ends_with_status_zero_on_both_nodes(tmp_path, script):
    job = _run_job(tmp_path, ["--max-steps", "3"])
    assert [node.returncode for node in job.nodes] == [0, 0], [node.output[-3000:] for node in job.nodes]
    assert not job.leftover
    _check_training(job, script, 3)
