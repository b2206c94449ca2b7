"""Issue #10, rank failure: when one rank of a 2-process AccelDDP job raises or is SIGKILLed, the job ends non-zero
within seconds, with the failing rank's error (or, for a silent SIGKILL, the dead rank's name) in its output.

Each job is a real script (``tests/scripts/rank_failure.py``) started with ``python``; Lightning's popen launcher starts
rank 1 itself, exactly as a user's run. gloo's collective timeout is 30 minutes, so a job that waited for it would hit
this test's own timeout instead. The two jobs run concurrently to keep the wall time down (each takes ~10-20 s,
mostly importing Lightning). Below them: AccelDDP's explanation of a peer's failure with real child processes, and a
non-finite loss on one rank under bf16/fp32, which must stop every rank at the same step without a hang.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.helpers import BNModel, make_dataset, make_loader, run_distributed, small_trainer_kwargs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "rank_failure.py"
LIMIT_S = 60.0  # the acceptance bound for the whole job
SHUTDOWN_S = 30.0  # from the failure to the job's exit; a hang would last gloo's 30-minute timeout
FAIL_STEP = 3


class _Job(NamedTuple):
    returncode: int
    output: str
    elapsed_s: float
    shutdown_s: float  # from the failing rank's marker to the job's exit
    leftover: bool  # a process of the job's session still alive after it exited


def _start(mode: str) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("MASTER_PORT", None)  # let Lightning pick a free port
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--mode", mode, "--rank", "1", "--step", str(FAIL_STEP)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: nothing of it may outlive the job
    )
    return proc, time.monotonic()


def _finish(proc: subprocess.Popen, started: float) -> _Job:
    try:
        output, _ = proc.communicate(timeout=2 * LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the job did not end within {2 * LIMIT_S:.0f} s:\n{output[-4000:]}")
    end_wall, elapsed = time.time(), time.monotonic() - started
    marker = re.search(r"FAILING_NOW_AT (\d+\.\d+)", output)
    shutdown = end_wall - float(marker.group(1)) if marker else float("inf")
    leftover = True
    for _ in range(50):  # every rank ends with the job; give an orphaned rank a moment to finish exiting
        if not _running_in_group(proc.pid):
            leftover = False
            break
        time.sleep(0.1)
    if leftover:
        os.killpg(proc.pid, signal.SIGKILL)
    return _Job(proc.returncode, output, elapsed, shutdown, leftover)


def _running_in_group(pgid: int) -> list[int]:
    """PIDs of the process group that still run (zombies, which only wait to be reaped, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: any member, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    running = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            running.append(int(stat.parent.name))
    return running


@pytest.fixture(scope="module")
def jobs() -> dict[str, _Job]:
    started = {mode: _start(mode) for mode in ("raise", "kill")}
    return {mode: _finish(*proc_start) for mode, proc_start in started.items()}


def _rank_one_named_dead(output: str, how: str) -> bool:
    """AccelDDP's note on rank 0, or Lightning's child-process observer if it killed rank 0 first."""
    note = re.search(rf"rank 1 \(PID \d+\) {how}", output)
    observer = re.search(r"\[rank: 1\] Child process with PID \d+ terminated with code", output)
    return bool(note or observer)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_job_exits_non_zero_quickly_and_leaves_nothing_running(jobs, mode):
    job = jobs[mode]
    assert job.returncode != 0, job.output[-4000:]
    assert job.elapsed_s < LIMIT_S, job.output[-4000:]
    assert job.shutdown_s < SHUTDOWN_S, job.output[-4000:]
    assert not job.leftover


def test_raising_rank_error_is_in_the_output(jobs):
    output = jobs["raise"].output
    assert f"RuntimeError: rank 1 failed on purpose at step {FAIL_STEP}" in output
    # rank 0 names it too: exited, or still printing its traceback when rank 0's short wait ended
    assert _rank_one_named_dead(output, "(?:exited with code 1|is still running)"), output[-4000:]


def test_killed_rank_is_named_although_it_printed_nothing(jobs):
    output = jobs["kill"].output
    assert "failed on purpose" not in output
    assert _rank_one_named_dead(output, "was killed by SIGKILL"), output[-4000:]


# ---------------------------------------------------------------------------------------------------------------
# The explanation itself, with real child processes (no distributed job needed)
# ---------------------------------------------------------------------------------------------------------------


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


_GLOO_RESET = "[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:41234: Connection reset by peer."


def test_explanation_names_a_killed_and_a_failed_rank():
    from lit_accel.strategies.parts._peer_failure import explain_peer_failure

    killed = _child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    failed = _child("raise SystemExit(3)")
    error = RuntimeError(_GLOO_RESET)
    assert explain_peer_failure(error, 3, [(1, killed), (2, failed)], wait_s=30)
    message = str(error)
    assert message.startswith(_GLOO_RESET)  # the original error stays first
    assert f"rank 1 (PID {killed.pid}) was killed by SIGKILL" in message
    assert f"rank 2 (PID {failed.pid}) exited with code 3" in message
    assert "out-of-memory killer" in message


def test_explanation_waits_only_briefly_for_a_running_rank():
    from lit_accel.strategies.parts._peer_failure import explain_peer_failure

    running = _child("import time; time.sleep(30)")
    try:
        error = RuntimeError("Connection closed by peer [127.0.0.1]:4000")
        start = time.monotonic()
        assert explain_peer_failure(error, 2, [(1, running)], wait_s=0.2)
        assert time.monotonic() - start < 5
        assert f"rank 1 (PID {running.pid}) is still running" in str(error)
    finally:
        running.kill()
        running.wait()


def test_explanation_without_children_says_where_to_look():
    from lit_accel.strategies.parts._peer_failure import explain_peer_failure

    error = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert explain_peer_failure(error, 8, [])
    assert "8-process job" in str(error) and "look for the first one" in str(error)


@pytest.mark.parametrize(
    "error",
    [ValueError("Connection reset by peer"), RuntimeError("CUDA out of memory"), RuntimeError(42), RuntimeError()],
    ids=["single-process", "other-error", "non-str-arg", "no-args"],
)
def test_other_errors_are_left_alone(error):
    from lit_accel.strategies.parts._peer_failure import explain_peer_failure

    before = error.args
    world_size = 1 if isinstance(error, ValueError) else 2
    assert not explain_peer_failure(error, world_size, [])
    assert error.args == before


# ---------------------------------------------------------------------------------------------------------------
# A non-finite loss on one rank (bf16/fp32): every rank stops at the same step, naming it; nothing is written
# ---------------------------------------------------------------------------------------------------------------

NAN_STEP = 2


def _nonfinite_on_rank_one(rank: int, world_size: int, precision: str) -> dict[str, object]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lit_accel import AccelDDP, AccelPrecision, NonFiniteGuard

    class NaNOnRankOne(BNModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if (self.global_rank, self.global_step) == (1, NAN_STEP) else loss

    class Snapshot(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before_last_batch = {k: p.detach().clone() for k, p in pl_module.named_parameters()}

    pl.seed_everything(0, verbose=False)
    model, snapshot = NaNOnRankOne(), Snapshot()
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            strategy=AccelDDP(),
            plugins=[AccelPrecision(precision)] if precision != "32-true" else [],  # fp32: Lightning's own plugin
            callbacks=[snapshot, NonFiniteGuard()],
            max_steps=6,
            use_distributed_sampler=False,
        )
    )
    try:
        trainer.fit(model, make_loader(make_dataset(64), 4, rank, world_size))
    except RuntimeError as err:
        # Parameters only: the forward of the bad batch legitimately updated BatchNorm's running statistics.
        after = dict(model.named_parameters())
        unchanged = all(torch.equal(after[k], snapshot.before_last_batch[k]) for k in after)
        return {"message": str(err), "step": trainer.global_step, "weights_unchanged": unchanged}
    return {"message": "", "step": trainer.global_step, "weights_unchanged": False}


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_nonfinite_loss_on_one_rank_stops_every_rank_at_that_step_without_writing_it(precision):
    start = time.monotonic()
    results = run_distributed(_nonfinite_on_rank_one, 2, precision, init_process_group=False, timeout=60)
    assert time.monotonic() - start < 30
    where = f"non-finite gradients (inf/NaN) at optimizer step {NAN_STEP} (batch_idx {NAN_STEP})"
    for result in results:  # rank 0's loss was finite: the all-reduced gradient carries the NaN to it
        assert where in result["message"]
        assert result["weights_unchanged"]  # the step was skipped before raising: the weights are still finite
