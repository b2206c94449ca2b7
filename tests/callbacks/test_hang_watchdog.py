"""Issues #20 and #29: HangWatchdog names a stuck rank with its stack and who waits for it; it ends the job only when
asked (``hang_timeout=``), and the strategies' default never ends a healthy job.

1. Real jobs: ``tests/scripts/hang_job.py`` started with ``python`` (Lightning's popen launcher starts the other ranks,
   ``AccelDDP(hang_timeout=5)``) and ``tests/scripts/hang_raw.py`` under torchrun. The default suite runs a rank
   sleeping forever in ``training_step`` on 2 processes. The slow suite adds a blocked dataset and a skipped
   collective on 2 and 4 processes, a deadlocked DataLoader worker, torchrun, a rank running its own code past the
   timeout, a 60-step run whose slow phases must not alarm, and the default AccelDDP/AccelFSDP with a rank working
   45 s between epochs (exit 0). The jobs of a group run concurrently to keep the wall time down.
2. The Lightning-free core on real gloo groups (``run_distributed``) with ``on_hang="report"``, where the stall ends
   after a while so the test can read every rank's verdict: stuck vs waiting, what the report says and on which
   ranks, once per stall, divergent, progress that must not alarm, world size 1.
3. The Lightning adapter: a DDPStrategy that appends it inside ``setup()``, phases and allowances, two instances, what
   the strategies add.
4. The verdict rules and the stack inspection on their own, and argument errors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from lit_accel.callbacks.hang_watchdog import REPORT_AFTER_S, HangWatchdog, add_hang_watchdog
from lit_accel.meters.progress_watchdog import (
    HANG_EXIT_CODE,
    HangReport,
    Position,
    ProgressWatchdog,
    RankState,
    dataloader_workers,
    format_report,
    judge,
    locate,
    rank_ranges,
)
from tests.helpers import find_free_port, run_distributed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "hang_job.py"
TIMEOUT = 5.0  # AccelDDP(hang_timeout=) in the jobs
DETECT_S = TIMEOUT + 10.0  # the bound from the hang to the end of the job
JOB_LIMIT_S = 300.0  # all jobs of a batch, imports included, on 2 busy cores; gloo's own timeout is 30 minutes


# ---------------------------------------------------------------------------------------------------------------
# 1. Real jobs
# ---------------------------------------------------------------------------------------------------------------


class _Job(NamedTuple):
    returncode: int
    output: str
    detect_s: float  # from the hanging rank's marker to the job's exit
    leftover: list[int]  # processes of the job's session still running after it exited


def _running_in_session(sid: int) -> list[int]:
    """PIDs of session ``sid`` that are not zombies (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _command(name: str, mode: str, devices: int, rank: int, tmp: Path) -> list[str]:
    args = [
        "--rank",
        str(rank),
        "--step",
        "3",
        *(("--timeout", str(TIMEOUT)) if not name.startswith("default") else ()),
    ]
    if mode == "raw":  # a raw PyTorch loop under torchrun
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(devices), "--master-port"]
        return [
            sys.executable,
            *launcher,
            str(find_free_port()),
            str(REPO / "tests" / "scripts" / "hang_raw.py"),
            *args,
        ]
    strategy = ["--strategy", "accel_fsdp"] if name.endswith("fsdp") else []
    bystander = ["--bystander"] if name in _BYSTANDER_JOBS else []
    return [sys.executable, str(SCRIPT), "--mode", mode, "--devices", str(devices), *args, *strategy, *bystander,
            "--root", str(tmp / name)]  # fmt: skip


class _Launch:
    """Jobs started at once, each in its own session, output to a file (no pipe to fill); a thread per job records
    the moment it exits, so that tests running meanwhile do not delay the measurement."""

    def __init__(self, specs: dict[str, tuple[str, int, int]], tmp: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
            env.pop(name, None)  # let Lightning's launcher pick a free port
        self.tmp, self.procs, self.ended, self.waiters = tmp, {}, {}, []
        for name, (mode, devices, rank) in specs.items():
            with open(tmp / f"{name}.log", "w") as log:
                cmd = _command(name, mode, devices, rank, tmp)
                self.procs[name] = subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            waiter = threading.Thread(target=self._wait, args=(name,), daemon=True)
            waiter.start()
            self.waiters.append(waiter)

    def _wait(self, name: str) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[name].wait(timeout=JOB_LIMIT_S)
            self.ended[name] = time.time()

    def results(self) -> dict[str, _Job]:
        for waiter in self.waiters:
            waiter.join()
        jobs = {}
        for name, proc in self.procs.items():
            if name not in self.ended:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            output = (self.tmp / f"{name}.log").read_text()
            assert name in self.ended, f"job {name} did not end within {JOB_LIMIT_S:.0f} s:\n{output[-6000:]}"
            leftover = _running_in_session(proc.pid)
            for _ in range(30):  # a rank killed a moment ago may still be exiting
                if not leftover:
                    break
                time.sleep(0.1)
                leftover = _running_in_session(proc.pid)
            if leftover:
                os.killpg(proc.pid, signal.SIGKILL)
            marker = re.search(r"HANG_STARTS_AT (\d+\.\d+)", output)
            detect = self.ended[name] - float(marker.group(1)) if marker else float("inf")
            jobs[name] = _Job(proc.returncode, output, detect, leftover)
        return jobs


# The default suite launches one job (~25 s on 2 cores, mostly importing Lightning twice); the others are @slow.
_JOBS = {"sleep-2": ("sleep", 2, 1)}
_SLOW_JOBS = {
    "divergent-2": ("divergent", 2, 1),
    "raw-2": ("raw", 2, 1),
    "dataloader-2": ("dataloader", 2, 1),
    "sleep-4": ("sleep", 4, 2),
    "dataloader-4": ("dataloader", 4, 3),
    "divergent-4": ("divergent", 4, 1),
    "own-code-2": ("epoch_end", 2, 0),
}
_DEFAULT_JOBS = {"default-ddp": ("epoch_end", 2, 0), "default-fsdp": ("epoch_end", 2, 0)}
_BYSTANDER_JOBS = {"sleep-2"}  # each rank starts a child of its own, which ending the job must leave running


@pytest.fixture(scope="module", autouse=True)
def _launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Launch | None:
    """Start the default jobs with this module's first test: they import Lightning while the tests below, which
    mostly wait out short timeouts, run. The job tests come last in the file."""
    if not any("jobs" in item.fixturenames for item in request.session.items):
        return None
    return _Launch(_JOBS, tmp_path_factory.mktemp("hang_jobs"))


@pytest.fixture(scope="module")
def jobs(_launched: _Launch) -> dict[str, _Job]:
    return _launched.results()


@pytest.fixture(scope="module")
def slow_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Job]:
    return _Launch(_SLOW_JOBS, tmp_path_factory.mktemp("hang_slow_jobs")).results()


def _check_ended_in_time(job: _Job) -> None:
    """Exit 124 in time, and nothing of the job left running but the children the job does not own."""
    assert job.returncode == HANG_EXIT_CODE, job.output[-6000:]
    assert "Forcefully terminating" not in job.output, job.output[-6000:]  # Lightning's launcher thread: no rank -9
    assert job.detect_s < DETECT_S, job.output[-6000:]
    bystanders = sorted(int(pid) for pid in re.findall(r"BYSTANDER_PID (\d+)", job.output))
    assert sorted(job.leftover) == bystanders, job.output[-6000:]


def _check_names_stuck_rank_phase_and_stack(output: str, devices: int, stuck: int, phase: str, frame: str) -> None:
    for rank in range(devices):  # every rank reports who is stuck and where
        head = f"[rank {rank}] HangWatchdog: rank {stuck} has made no progress for "
        assert re.search(re.escape(head) + rf"[\d.]+ s in phase '{phase}' \(step 3, allowance 5 s\)", output), output
    # The stuck rank's main-thread stack reached rank 0 through the store, down to the blocking call ...
    stack = re.search(rf"\[rank 0\] Main-thread stack of rank {stuck} .*?\n((?:\[rank 0\]   File .*\n)+)", output)
    assert stack, output[-6000:]
    assert re.search(rf'hang_job.py", line \d+, in .*{frame}\n.*hang_job.py", line \d+, in _block_forever', stack[1])
    # ... and every rank printed it, so the stuck rank's own log has its stack too
    assert re.search(rf'\[rank {stuck}\]   File ".*hang_job.py", line \d+, in _block_forever', output), output[-6000:]
    assert re.search(rf"\[rank 0\]   rank [\d, -]+: phase .* waiting for rank {stuck} in ", output), output[-6000:]


def _check_divergent(output: str, devices: int) -> None:
    assert re.search(r"\[rank 0\] HangWatchdog: the ranks diverged, they wait in different places", output), output
    # rank 0 waits in the metric sync the other rank skipped; rank 1 already waits in the next step's collective
    validation = (
        r"phase 'validation' \(step 4\) for \d+ s: waiting (for rank 1 )?in torch.distributed.all_reduce, called"
    )
    assert re.search(r"\[rank 0\]   rank [\d, -]+: " + validation + ".*on_validation_epoch_end", output), output
    assert re.search(r"phase 'data' \(step 4\) for \d+ s: waiting in torch.distributed.broadcast", output), output
    for rank in range(devices):
        assert f"[rank {rank}] HangWatchdog: the ranks diverged" in output
    assert "What to look at: control flow that differs between ranks" in output


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (mode, _, _) in _SLOW_JOBS.items() if mode not in ("raw",)])
def test_more_jobs_end_in_time_and_name_the_culprit(slow_jobs, name):
    """The divergent jobs: a rank that skips one all_reduce the others make is reported as divergent, naming both
    places. A rank blocked in training_step or in its dataset, on 2 and 4 processes. A rank running its own code in
    on_train_epoch_end past the opt-in timeout (phase 'data'): reported as running that code, not the data pipeline."""
    mode, devices, rank = _SLOW_JOBS[name]
    job = slow_jobs[name]
    _check_ended_in_time(job)
    if mode == "divergent":
        _check_divergent(job.output, devices)
        if devices > 2:  # 3 ranks agree, one does not: it is named (with 2 ranks there is no majority)
            assert f"rank {rank} took another path" in job.output
    elif mode == "epoch_end":
        assert "rank 0 has made no progress for" in job.output and "in phase 'data' (step 8" in job.output
        own = r"rank 0: phase 'data' \(step 8\) for \d+ s: running your code at tests/scripts/hang_job.py:\d+ in "
        assert re.search(own + "_Rank0Work.on_train_epoch_end", job.output), job.output[-6000:]
        assert "What to look at: your code at tests/scripts/hang_job.py" in job.output
        assert "data pipeline" not in job.output, job.output[-6000:]
    else:
        phase, frame = ("training_step", "training_step") if mode == "sleep" else ("data", "__getitem__")
        _check_names_stuck_rank_phase_and_stack(job.output, devices, rank, phase, frame)
        if mode == "dataloader":
            assert f"rank {rank}: phase 'data' (step 3) for" in job.output
            assert "waiting for the data pipeline in torch.utils.data" in job.output
            assert "What to look at: the data pipeline" in job.output


@pytest.mark.slow
def test_default_strategies_never_end_a_healthy_job(tmp_path):
    """Default AccelDDP() and AccelFSDP(), 2 processes, rank 0 working 45 s in on_train_epoch_end of the first of two
    epochs (the others wait for it in the next collective): the fit finishes, exit code 0, every step taken."""
    results = _Launch(_DEFAULT_JOBS, tmp_path).results()
    for name, job in results.items():
        assert job.returncode == 0, (name, job.output[-6000:])
        assert "rank 0 finished 16 steps" in job.output and "rank 1 finished 16 steps" in job.output, job.output
        assert "HangWatchdog" not in job.output, job.output[-6000:]  # nothing reported either: 45 s is no stall
        assert job.detect_s >= 45.0 and not job.leftover, job.output[-6000:]  # the work really happened


@pytest.mark.slow
def test_slow_first_step_validation_checkpoint_and_rank_do_not_raise_an_alarm(tmp_path):
    """60 steps under a 5 s timeout with an 8 s first step, a 20 s validation, three 10 s checkpoint saves, and a rank
    0.3 s slower than the other at every step: none of it is a hang."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("MASTER_PORT", None)
    cmd = [sys.executable, str(SCRIPT), "--mode", "slow_ok", "--timeout", "5", "--max-steps", "60"]
    done = subprocess.run(
        [*cmd, "--root", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "HangWatchdog:" not in output
    assert "rank 0 finished 60 steps" in output and "rank 1 finished 60 steps" in output
    assert len(list(tmp_path.rglob("*.ckpt"))) == 3  # steps 20, 40, 60: the slow saves happened


@pytest.mark.slow
def test_a_deadlocked_dataloader_worker_is_found(tmp_path):
    job = _Launch({"worker-2": ("worker", 2, 1)}, tmp_path).results()["worker-2"]
    assert job.returncode == HANG_EXIT_CODE and job.detect_s < DETECT_S and not job.leftover, job.output[-6000:]
    assert re.search(r"rank 1 has made no progress for [\d.]+ s in phase 'data' \(step 3", job.output), job.output
    # the main process waits for its worker: the data pipeline, named by the DataLoader's own frame
    assert "waiting for the data pipeline in torch.utils.data.dataloader" in job.output
    assert "What to look at: the data pipeline" in job.output


# ---------------------------------------------------------------------------------------------------------------
# 2. The core on real gloo groups. on_hang="report": the stall ends after a while, so every rank returns its verdict.
# ---------------------------------------------------------------------------------------------------------------

CORE_TIMEOUT, CORE_INTERVAL = 1.0, 0.2


def _wait_for_report(watchdog: ProgressWatchdog, limit_s: float, step: int | None = None) -> None:
    """The rank's "stuck" code: sleep until the watchdog has a verdict (about ``step``, if given), or ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        report = watchdog.report
        if report is not None and (step is None or {s.step for s in report.states} == {step}):
            return
        time.sleep(0.05)


def _summary(report: HangReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"verdict": report.verdict, "culprits": report.culprits, "states": {s.rank: s for s in report.states}}


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Send this process's file descriptor 2 (where the watchdog writes) to ``path`` for a while."""
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _stuck_twice_in_user_code(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank 1 stalls twice in its own code (phase 'data', as in a callback between steps); the others wait for it in
    an all_reduce. Each stall is reported once, by the judge (rank 0) and the blamed rank only."""
    import torch.distributed as dist

    log = Path(tmp) / f"rank{rank}.log"
    watchdog = ProgressWatchdog(CORE_TIMEOUT, interval=CORE_INTERVAL, on_hang="report")
    with _stderr_to(log):
        watchdog.start()
        for step in range(4):
            watchdog.enter("data", step)
            if rank == 1 and step in (1, 3):
                _wait_for_report(watchdog, 15.0, step)  # "stuck" until the ranks have a verdict about this stall
                time.sleep(3 * CORE_INTERVAL)  # still stuck: the judge must not report the same stall again
            watchdog.enter("step", step)
            dist.all_reduce(torch.ones(2))
        watchdog.enter("finishing", allowance=60.0)
        time.sleep(5 * CORE_INTERVAL)  # every rank's thread reads the last verdict before stopping
        watchdog.stop()
    return {**_summary(watchdog.report), "reports": watchdog._handled, "log": log.read_text()}


def test_core_blames_the_rank_in_its_own_code_once_per_stall_on_the_ranks_concerned(tmp_path):
    results = run_distributed(_stuck_twice_in_user_code, 3, str(tmp_path), timeout=90)
    for result in results:
        assert result["verdict"] == "stuck" and result["culprits"] == (1,) and result["reports"] == 2
        stuck, waiting = result["states"][1], result["states"][0]
        assert (stuck.kind, stuck.phase, stuck.step) == ("running", "data", 3)
        assert CORE_TIMEOUT < stuck.stall_s < CORE_TIMEOUT + 4 * CORE_INTERVAL + 2.0  # found a few ticks late
        assert stuck.user.endswith("in _wait_for_report") and "_wait_for_report" in stuck.stack
        assert (waiting.kind, waiting.phase, waiting.call) == ("collective", "step", "torch.distributed.all_reduce")
        assert waiting.site.endswith("in _stuck_twice_in_user_code") and waiting.stack is None  # stacks: culprits only
    heads = [re.findall(r"\[rank \d\] HangWatchdog: .*", r["log"]) for r in results]
    assert [len(h) for h in heads] == [2, 2, 0], heads  # the judge and the blamed rank, once per stall; not rank 2
    log = results[0]["log"]
    assert "HangWatchdog: rank 1 has made no progress for" in log and "in phase 'data' (step 1" in log
    here = "tests/callbacks/test_hang_watchdog.py"
    assert re.search(rf"rank 1: phase 'data' \(step 3\) for \d+ s: running your code at {here}:\d+ in _wait_for_r", log)
    assert re.search(r"rank 0, 2: phase 'step' \(step 3\) for \d+ s: waiting for rank 1 in torch.distributed.al", log)
    assert f"What to look at: your code at {here}" in log and "data pipeline" not in log  # the stack decides
    assert "Report only: the job goes on" in log and "Main-thread stack of rank 1" in log


def _divergent_groups(rank: int, world_size: int) -> dict[str, Any] | None:
    """Each rank waits in a collective of a different group: a deadlock. Once the verdict is in, a helper thread
    enters the collective the peer waits in, which releases both."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    watchdog = ProgressWatchdog(CORE_TIMEOUT, interval=CORE_INTERVAL, on_hang="report")
    watchdog.start()

    def release_peer() -> None:
        deadline = time.monotonic() + 15.0
        while watchdog.report is None and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.all_reduce(torch.ones(1), group=groups[1 - rank])

    helper = threading.Thread(target=release_peer)
    helper.start()
    watchdog.enter("metrics" if rank == 0 else "forward", 5)
    dist.all_reduce(torch.ones(1), group=groups[rank])
    helper.join()
    watchdog.stop()
    return _summary(watchdog.report)


def test_core_reports_ranks_waiting_in_different_collectives_as_divergent():
    for result in run_distributed(_divergent_groups, 2, timeout=60):
        assert result["verdict"] == "divergent" and result["culprits"] == ()  # one rank each side: no majority
        first, second = result["states"][0], result["states"][1]
        assert (first.kind, first.phase, second.kind, second.phase) == (
            "collective",
            "metrics",
            "collective",
            "forward",
        )
        assert first.call == second.call == "torch.distributed.all_reduce"


def _waiting_for_a_progressing_rank(rank: int, world_size: int) -> dict[str, Any] | None:
    """Rank 1 validates for 2 s in 0.4 s batches (allowance 10 s) while rank 0 waits in a collective of a phase with
    a 1 s allowance: rank 0 is past its allowance, but the rank it waits for progresses. Not a hang; nor is rank 0
    running on in that phase afterwards, nor rank 1 finishing while rank 0 is still on its way out."""
    import torch.distributed as dist

    watchdog = ProgressWatchdog(CORE_TIMEOUT, interval=CORE_INTERVAL, on_hang="report")
    watchdog.start()
    if rank == 1:
        for batch in range(5):
            watchdog.enter("validation", batch, allowance=10.0)
            time.sleep(0.4)
    watchdog.enter("forward", 0)
    dist.all_reduce(torch.ones(1))
    time.sleep(0.4)  # rank 0 runs on in the same phase: its stall counts from the end of the wait, not from 2 s ago
    watchdog.stop()
    return _summary(watchdog.report)


def test_core_sees_no_hang_while_the_awaited_rank_progresses():
    assert run_distributed(_waiting_for_a_progressing_rank, 2, timeout=60) == [None, None]


def _a_rank_that_stops_publishing(rank: int, world_size: int) -> dict[str, Any] | None:
    """Rank 1's watchdog thread stops while its last state is within the allowance (a frozen process publishes
    nothing more); rank 0 waits for it in an all_reduce and must still blame it, by ageing that state."""
    import torch.distributed as dist

    watchdog = ProgressWatchdog(CORE_TIMEOUT, interval=CORE_INTERVAL, on_hang="report")
    watchdog.start()
    watchdog.enter("data", 0)
    if rank == 1:
        time.sleep(2 * CORE_INTERVAL)
        watchdog._stop.set()  # "frozen": no state after this one, no final "finished" either
        time.sleep(4 * CORE_TIMEOUT)
    dist.all_reduce(torch.ones(1))
    watchdog.stop()
    return _summary(watchdog.report)


def test_a_rank_that_stops_publishing_is_blamed_where_it_was_last_seen():
    result = run_distributed(_a_rank_that_stops_publishing, 2, timeout=60)[0]
    assert result is not None and result["verdict"] == "stuck" and result["culprits"] == (1,)
    assert result["states"][1].stall_s > CORE_TIMEOUT and result["states"][1].phase == "data"


def test_world_size_one_still_reports_its_own_stall(capfd):
    watchdog = ProgressWatchdog(1.0, interval=0.2, on_hang="report")
    watchdog.start()  # no process group: the process watches itself
    watchdog.enter("data", 7)
    _wait_for_report(watchdog, 10.0)
    watchdog.stop()
    assert watchdog.report is not None and watchdog.report.verdict == "stuck" and watchdog.report.culprits == (0,)
    err = capfd.readouterr().err
    assert re.search(r"\[rank 0\] HangWatchdog: rank 0 has made no progress for [\d.]+ s in phase 'data' \(step 7", err)
    assert "the other ranks wait" not in err and "running your code at tests/callbacks/test_hang_watchdog.py" in err


def test_a_followed_source_moves_the_record_and_an_event_holds_until_the_source_moves_on():
    count = [0]  # a loop's own counter (Lightning's: its batch progress); the thread reads it once per interval
    watchdog = ProgressWatchdog(5.0)
    watchdog.follow(lambda: Position(count[0], "step" if count[0] % 2 else "data", count[0] // 2, 5.0))
    watchdog.enter("setup", allowance=50.0)
    assert watchdog.current()[1:4] == ("setup", None, 50.0)  # no move since the event: the event holds
    count[0] = 3
    moved = watchdog.current()
    assert (moved.phase, moved.step, moved.allowance_s, moved.changes + moved.position) == ("step", 1, 5.0, 4)
    watchdog.enter("checkpoint", 1, 500.0)  # what the counters do not show, at the same count
    assert watchdog.current()[1:4] == ("checkpoint", 1, 500.0)
    count[0] = 4
    assert watchdog.current()[1:4] == ("data", 2, 5.0)
    # The thread times a move from when it first saw it, and keeps that start while the count stands still.
    assert watchdog._current(100.0).started == 100.0 and watchdog._current(160.0).started == 100.0
    count[0] = 5
    assert watchdog._current(170.0).started == 170.0
    watchdog.follow(None)
    assert watchdog.current().phase == "checkpoint"  # without a source: the events alone


@pytest.mark.slow
def test_raw_pytorch_loop_under_torchrun_ends_every_rank_with_the_hang_exit_code(slow_jobs):
    """No Lightning, an external launcher (torchrun's agent hosts the store and stops the job when a rank fails)."""
    job = slow_jobs["raw-2"]
    assert job.returncode != 0 and job.detect_s < DETECT_S and not job.leftover, job.output[-6000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] HangWatchdog: rank 1 has made no progress .* in phase 'forward' \(step 3",
                         job.output), job.output[-6000:]  # fmt: skip
    assert re.search(rf"exitcode +: {HANG_EXIT_CODE} \(pid", job.output), job.output[-6000:]  # torchrun's table


# ---------------------------------------------------------------------------------------------------------------
# 3. The Lightning adapter
# ---------------------------------------------------------------------------------------------------------------


def _lightning_stuck_dataloader(rank: int, world_size: int) -> dict[str, Any]:
    """A DDPStrategy that appends a HangWatchdog inside setup() (as AccelDDP will); rank 1's dataset blocks at the
    first item of step 2 until the watchdog has a verdict."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    class AppendingDDP(DDPStrategy):
        def setup(self, trainer: pl.Trainer) -> None:
            if not any(isinstance(cb, HangWatchdog) for cb in trainer.callbacks):
                trainer.callbacks.append(HangWatchdog(1.5, interval=CORE_INTERVAL, on_hang="report"))
            super().setup(trainer)

    class Blocking(Dataset):
        calls = 0

        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> torch.Tensor:
            Blocking.calls += 1
            if rank == 1 and Blocking.calls == 2 * 4 + 1:
                watchdog = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog)).watchdog
                _wait_for_report(watchdog, 15.0)
            return torch.full((8,), float(index))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=AppendingDDP(),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(Blocking(), batch_size=4))
    watchdog = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
    return {
        **_summary(watchdog.report),
        "running_after_fit": watchdog.watchdog._thread is not None,
        "steps": trainer.global_step,
    }


def test_lightning_watchdog_appended_by_a_ddp_strategy_in_setup_finds_a_stuck_dataloader():
    for result in run_distributed(_lightning_stuck_dataloader, 2, init_process_group=False, timeout=90):
        assert result["verdict"] == "stuck" and result["culprits"] == (1,)
        stuck, waiting = result["states"][1], result["states"][0]
        assert (stuck.phase, stuck.step, stuck.kind) == ("data", 2, "data")  # the stack: inside a DataLoader
        assert stuck.call.startswith("torch.utils.data.") and stuck.user.endswith("in _wait_for_report")
        assert "__getitem__" in stuck.stack and "_wait_for_report" in stuck.stack
        assert waiting.kind == "collective" and waiting.step == 2
        assert result["steps"] == 4 and not result["running_after_fit"]  # the fit finished; the thread stopped


def _tiny_fit(callbacks: list[Any], tmp_path: Path, **kwargs: Any) -> Any:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers import BNModel

    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(BNModel(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _record_hook(phases: _Phases, where: str, *args: Any, **kwargs: Any) -> None:
    phases.record(where)


class _Phases:
    """Records what the watchdog's thread would judge (``current()``) at points of a fit: where, phase, step, allowance.

    Points: the dataset's ``__getitem__`` ("fetch"), callback hooks, and the module's ``on_train_batch_end`` (after
    every callback's, a checkpoint saved there included). Also checks that the published ``seq`` never goes back.
    """

    def __init__(self, watchdog: HangWatchdog) -> None:
        self.watchdog, self.seen, self.seqs = watchdog, [], []

    def record(self, where: str) -> None:
        p = self.watchdog.watchdog.current()
        if self.watchdog.watchdog._thread is not None:  # watched: between on_fit_start and on_train_end
            self.seen.append((where, p.phase, p.step, p.allowance_s))
            self.seqs.append(p.changes + p.position)

    def callback(self) -> Any:
        import lightning.pytorch as pl

        hooks = ["on_sanity_check_start", "on_train_batch_start", "on_before_optimizer_step",
                 "on_validation_batch_start", "on_validation_end", "on_save_checkpoint"]  # fmt: skip
        return type("Recorder", (pl.Callback,), {h: functools.partial(_record_hook, self, h) for h in hooks})()

    def fit(self, tmp_path: Path, strategy: Any = "auto", ckpt_path: Any = None, **kwargs: Any) -> Any:
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader, Dataset

        from tests.helpers import BNModel

        record = self.record

        class Recorded(Dataset):
            def __len__(self) -> int:
                return 16

            def __getitem__(self, i: int) -> Any:
                if i % 4 == 0:  # once per batch of 4
                    record("fetch")
                return torch.full((8,), float(i)), torch.zeros(4)

        class Model(BNModel):
            def on_train_batch_end(self, *args: Any) -> None:
                record("module.on_train_batch_end")

        checkpoints = pl.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, default_root_dir=tmp_path, logger=False,
                             callbacks=[self.watchdog, self.callback(), checkpoints], enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)  # fmt: skip
        data = DataLoader(Recorded(), batch_size=4)
        trainer.fit(Model(), data, DataLoader(Recorded(), batch_size=4), ckpt_path=ckpt_path)
        assert self.seqs == sorted(self.seqs), self.seqs  # ranks compare it: the smallest is furthest behind
        return trainer


@pytest.mark.parametrize("strategy", ["ddp", "accel_ddp"])
def test_the_training_loops_counters_and_hooks_give_the_phases_and_their_allowances(tmp_path, strategy):
    watchdog = HangWatchdog(7.0, first_step_timeout=70.0, validation_timeout=700.0, checkpoint_timeout=7000.0)
    phases = _Phases(watchdog)
    phases.fit(tmp_path, strategy, max_steps=3, limit_val_batches=1, num_sanity_val_steps=1, val_check_interval=2)
    fetches = [(phase, step, allowance) for where, phase, step, allowance in phases.seen if where == "fetch"]
    seen = [row for row in phases.seen if row[0] != "fetch"]
    assert seen[:3] == [
        ("on_sanity_check_start", "setup", 0, 70.0),
        ("on_validation_batch_start", "sanity_check", 0, 700.0),
        ("on_validation_end", "data", 0, 70.0),  # after the sanity check: still the first step's allowance
    ]
    assert seen[3:7] == [
        ("on_train_batch_start", "training_step", 0, 70.0),
        ("on_before_optimizer_step", "training_step", 0, 70.0),
        ("on_save_checkpoint", "checkpoint", 1, 7000.0),  # ModelCheckpoint saves in on_train_batch_end
        ("module.on_train_batch_end", "checkpoint", 1, 7000.0),  # until the loop moves on
    ]
    assert seen[7:9] == [
        ("on_train_batch_start", "training_step", 1, 7.0),
        ("on_before_optimizer_step", "training_step", 1, 7.0),
    ]
    assert ("on_validation_batch_start", "validation", 2, 700.0) in seen
    assert [row for row in seen if row[0] == "on_validation_end"][-1] == ("on_validation_end", "data", 2, 7.0)
    # A training fetch runs in "data" (the first with the first step's allowance), a validation one in its loop's.
    assert fetches == [
        ("sanity_check", 0, 700.0),
        ("data", 0, 70.0),
        ("data", 1, 7.0),  # not the checkpoint's: the batch before completed
        ("validation", 2, 700.0),
        ("data", 2, 7.0),
    ], fetches
    assert watchdog.watchdog._thread is None and watchdog.report is None


def test_a_resumed_fit_counts_its_first_step_from_the_restored_counters(tmp_path):
    trainer = _tiny_fit([HangWatchdog(7.0)], tmp_path, max_steps=2, limit_val_batches=0)
    checkpoint = tmp_path / "two_steps.ckpt"
    trainer.save_checkpoint(checkpoint)
    phases = _Phases(HangWatchdog(7.0, first_step_timeout=70.0))
    phases.fit(tmp_path / "resumed", max_steps=4, limit_val_batches=0, ckpt_path=checkpoint)
    steps = [(step, allowance) for where, _, step, allowance in phases.seen if where == "on_train_batch_start"]
    assert steps == [(2, 70.0), (3, 7.0)]


def test_slow_first_step_validation_and_checkpoint_within_their_allowances_raise_no_alarm(tmp_path):
    import lightning.pytorch as pl

    slept: list[str] = []

    class Slow(pl.Callback):  # each slower than the training timeout, within its own allowance
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 0:
                slept.append("first step")
                time.sleep(1.0)

        def on_validation_batch_start(self, *args: Any) -> None:
            slept.append("validation")
            time.sleep(1.0)

        def on_save_checkpoint(self, *args: Any) -> None:
            slept.append("checkpoint")
            time.sleep(1.0)

    watchdog = HangWatchdog(0.6, 4.0, 4.0, 4.0, interval=0.15, on_hang="report")
    _tiny_fit(
        [watchdog, Slow()], tmp_path, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=2
    )
    assert watchdog.report is None
    assert {"first step", "validation", "checkpoint"} <= set(slept), slept  # each slow phase happened


def test_a_users_hang_watchdog_reports_a_stall_by_default_and_the_job_goes_on(tmp_path, monkeypatch, capfd):
    """Issue #51: a callback a user adds to watch never ends the job unless asked (``on_hang="exit"``)."""
    import lightning.pytorch as pl

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # had it ended the job, this test process would be gone

    class Stall(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                time.sleep(2.0)

    watchdog = HangWatchdog(0.6, first_step_timeout=30.0, interval=0.15)  # on_hang left at its default
    trainer = _tiny_fit([watchdog, Stall()], tmp_path, max_steps=4, limit_val_batches=0, enable_checkpointing=False)
    assert watchdog.report is not None and watchdog.report.culprits == (0,)
    assert "HangWatchdog: rank 0 has made no progress for" in capfd.readouterr().err
    assert trainer.global_step == 4 and exits == []


def test_a_second_watchdog_in_the_same_trainer_stays_passive(tmp_path):
    first, second = HangWatchdog(60.0), HangWatchdog(30.0)
    with pytest.warns(UserWarning, match=r"HangWatchdog\(timeout=30\) stays passive.*Fix: pass a single"):
        _tiny_fit([first, second], tmp_path, max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    assert first.watchdog.progress.changes > 0 and second.watchdog.progress.changes == 0


def test_strategies_add_a_report_only_watchdog_by_default_and_end_jobs_only_when_asked(tmp_path):
    import inspect

    import lightning.pytorch as pl

    from lit_accel import AccelDDP, AccelFSDP, AccelParallel

    for cls in (AccelDDP, AccelFSDP, AccelParallel):  # no hang argument: nothing may end the job
        assert inspect.signature(cls).parameters["hang_timeout"].default is None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    add_hang_watchdog(trainer, None)
    default = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
    assert default.watchdog.on_hang == "report" and default.timeout == REPORT_AFTER_S >= 300
    assert min(default.first_step_timeout, default.validation_timeout, default.checkpoint_timeout) >= 600
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    add_hang_watchdog(trainer, 5.0)  # opt-in: ends the job; the longer phases keep 600 s; found within a second
    added = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
    assert (added.watchdog.on_hang, added.timeout, added.validation_timeout, added.watchdog.interval) == (
        "exit",
        5.0,
        600.0,
        0.5,
    )
    own = HangWatchdog(60.0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[own], default_root_dir=tmp_path)
    add_hang_watchdog(trainer, 5.0)  # the user's own wins
    assert [cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog)] == [own]


# ---------------------------------------------------------------------------------------------------------------
# 4. The verdict rules, stack inspection, arguments
# ---------------------------------------------------------------------------------------------------------------


def _state(rank: int, kind: str = "running", stall: float = 0.0, allowance: float = 5.0, **kw: Any) -> RankState:
    fields = {"seq": 10, "phase": "forward", "step": 3, "call": None, "site": None, **kw}
    return RankState(rank, stall_s=stall, allowance_s=allowance, pid=100 + rank, host="h", kind=kind, **fields)


def _verdict(states: list[RankState], quiet: float | None = None) -> Any:
    live = [s.stall_s for s in states if s.status == "running"]
    quiet = min(live, default=0.0) if quiet is None else quiet  # as if every state had just been seen
    report = judge({s.rank: s for s in states}, quiet)
    return None if report is None else (report.verdict, report.culprits)


def test_rules_blame_the_overdue_running_rank_furthest_behind_first():
    states = [_state(0, "collective", 9), _state(1, "running", 9, seq=8), _state(2, "running", 6, seq=9)]
    assert _verdict(states) == ("stuck", (1,))  # rank 2 is stalled too, but further ahead: it waits for rank 1
    states = [_state(0, "collective", 9), _state(1, "running", 9, seq=8), _state(2, "running", 6, seq=8)]
    assert _verdict(states) == ("stuck", (1, 2))
    assert _verdict([_state(0, "collective", 9), _state(1, "data", 6)]) == ("stuck", (1,))  # a DataLoader wait


def test_rules_do_not_alarm_while_the_awaited_rank_is_within_its_allowance():
    assert _verdict([_state(0, "collective", 60), _state(1, "running", 30, allowance=600)]) is None
    assert _verdict([_state(0, "collective", 60), _state(1, "debugger", 60)]) is None  # someone sits in pdb


def test_rules_for_ranks_that_all_wait():
    same = {"call": "torch.distributed.all_reduce", "site": "a.py:1 in f"}
    # the same collective everywhere: the longest allowance applies (a long gather while checkpointing)
    waiting = [_state(0, "collective", 20, 5, **same), _state(1, "collective", 20, 600, phase="checkpoint", **same)]
    assert _verdict(waiting) == ("divergent", ())  # ... but the phases differ, so they cannot meet: the shortest
    same_phase = [_state(0, "collective", 20, 600, **same), _state(1, "collective", 20, 600, **same)]
    assert _verdict(same_phase) is None
    assert _verdict([_state(r, "collective", 700, 600, **same) for r in range(2)]) == ("waiting", ())
    # three ranks agree, one waits elsewhere: it is the one that diverged
    other = {"call": "torch.distributed.broadcast", "site": "b.py:2 in g"}
    four = [_state(r, "collective", 9, **same) for r in (0, 2, 3)] + [_state(1, "collective", 9, **other)]
    assert _verdict(four) == ("divergent", (1,))
    # one finished (its watchdog stopped) while the other waits
    assert _verdict([_state(0, "collective", 9, **same), _state(1, status="finished")]) == ("divergent", ())
    # one rank just changed (it finished, or entered the collective): not yet a divergence
    assert _verdict([_state(0, "collective", 9, **same), _state(1, status="finished")], quiet=0.2) is None


def test_report_text_names_ranks_places_and_the_fix():
    states = {
        0: _state(0, "collective", 4.2, 3, call="torch.distributed.all_reduce", site="job.py:9 in step"),
        1: _state(1, "running", 4.5, 3, call="job.py:5 in load", user="job.py:5 in load", stack="  File x"),
        2: _state(2, "collective", 4.0, 3, call="torch.distributed.all_reduce", site="job.py:9 in step"),
    }
    text = format_report(judge(states, 4.0), HANG_EXIT_CODE)
    assert text.startswith(
        "HangWatchdog: rank 1 has made no progress for 4.5 s in phase 'forward' (step 3, allowance 3 s);"
        " the other ranks wait for it."
    )
    assert "  rank 1: phase 'forward' (step 3) for 4 s: running your code at job.py:5 in load" in text
    assert "  rank 0, 2: phase 'forward' (step 3) for 4 s: waiting for rank 1 in torch.distributed.all_reduce" in text
    assert "Main-thread stack of rank 1 (pid 101 on h)" in text and "  File x" in text
    assert "What to look at: your code at job.py:5 in load" in text and "data pipeline" not in text
    assert f"Ending every rank with exit code {HANG_EXIT_CODE}" in text
    states[1] = _state(1, "data", 4.5, 3, call="torch.utils.data.dataloader.x", user="job.py:7 in __getitem__")
    text = format_report(judge(states, 4.0), None)
    assert "rank 1: phase 'forward' (step 3) for 4 s: waiting for the data pipeline in torch.utils.data." in text
    assert "What to look at: the data pipeline" in text and "Report only: the job goes on" in text
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def _parked(event: threading.Event) -> None:
    event.wait()


def test_stack_inspection_of_own_code_a_dataloader_and_a_traced_thread():
    from torch.utils.data import DataLoader

    event = threading.Event()

    class Blocking(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            _parked(event)
            return torch.zeros(1)

    def traced() -> None:
        sys.settrace(lambda frame, evt, arg: lambda *b: None)  # what a debugger does: local tracers (f_trace)
        _parked(event)

    threads = [
        threading.Thread(target=_parked, args=(event,)),
        threading.Thread(target=lambda: next(iter(DataLoader(Blocking())))),
        threading.Thread(target=traced),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    try:
        plain, data, debugged = (locate(t.ident, with_stack=True) for t in threads)
        assert plain["kind"] == "running" and plain["user"].endswith("in _parked") and plain["site"] == plain["user"]
        assert plain["user"].startswith("tests/callbacks/test_hang_watchdog.py:")  # this file is "your code"
        assert plain["stack"].endswith("in Condition.wait") and "in _parked\n" in plain["stack"]  # innermost last
        assert data["kind"] == "data" and data["call"].startswith("torch.utils.data.")
        assert data["user"].endswith("in _parked") and "__getitem__" in data["stack"]
        assert debugged == {"kind": "debugger"}
    finally:
        event.set()
        for thread in threads:
            thread.join()
    assert locate(threads[0].ident) == {"kind": "gone"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, r"HangWatchdog\(timeout=0\): expected a finite number > 0\. Fix: pass"),
        ({"timeout": float("nan")}, ValueError, r"timeout=nan"),
        ({"timeout": "30"}, TypeError, r"timeout='30'"),
        ({"first_step_timeout": -1}, ValueError, r"first_step_timeout=-1\): expected a finite number > 0"),
        ({"interval": 0}, ValueError, r"interval=0\): expected a finite number > 0"),
        ({"on_hang": "kill"}, ValueError, r"on_hang='kill'\): expected one of 'exit', 'report'\. Fix"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        HangWatchdog(**kwargs)


def test_the_dataloader_workers_ended_with_the_job_are_the_loaders_and_no_other_child():
    """Found by the name torch's worker loop gives its thread (``pt_data_worker``): a user's own child is not one."""
    import multiprocessing
    import time

    other = multiprocessing.Process(target=time.sleep, args=(60,), daemon=True)  # a child of the user's own
    other.start()
    try:
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, persistent_workers=True)
        batches = iter(loader)
        next(batches)  # the workers are running
        workers = dataloader_workers()
        assert len(workers) == 2 and other not in workers and all(w.is_alive() for w in workers)
        del batches
    finally:
        other.kill()
        other.join()


def test_core_start_without_a_process_group_for_several_ranks_says_what_to_do(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"no process group\. Fix: .*start it after init_process_group"):
        ProgressWatchdog(5.0).start()


def test_ending_the_process_needs_no_new_thread(monkeypatch):
    """Out of memory no thread can start: ending must not need one (a job that cannot end would hang)."""
    exits: list[int] = []

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(os, "_exit", exits.append)
    watchdog = ProgressWatchdog(5.0)
    watchdog._children = []
    watchdog._end()
    assert exits == [HANG_EXIT_CODE]


def test_a_launcher_exits_before_the_ranks_it_launched_and_kills_only_those_that_never_finished(monkeypatch):
    """Lightning's launcher thread SIGKILLs every rank, itself included, once a launched rank has exited non-zero (the
    job then reads -9, not 124): the launcher exits first. A launched rank that marked the end of its work is left
    to exit after it; one that never marked it (stuck beyond its own watchdog) is killed after the grace."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    done, stuck = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    try:
        watchdog = ProgressWatchdog(5.0, interval=0.2)
        watchdog._children, watchdog._store = [done, stuck], torch.distributed.HashStore()
        watchdog._host, watchdog._pid = "host", os.getpid()
        watchdog._store.set(f"ended/host/{done.pid}", "1")  # what the launched rank's own _end() writes
        started = time.monotonic()
        watchdog._end()
        assert exits == [HANG_EXIT_CODE] and time.monotonic() - started < 2 * watchdog._grace
        assert stuck.wait(5) == -signal.SIGKILL and done.poll() is None
    finally:
        for child in (done, stuck):
            child.kill()
            child.wait()


# ---------------------------------------------------------------------------------------------------------------
# The default job (started by ``_launched`` with this module's first test), checked last
# ---------------------------------------------------------------------------------------------------------------


def test_job_ends_non_zero_within_seconds_of_the_timeout_and_leaves_nothing_running(jobs):
    """Ending the job ends only what it owns: the child each rank started of its own (a logger's, say) survives."""
    assert len(re.findall(r"BYSTANDER_PID \d+", jobs["sleep-2"].output)) == 2, jobs["sleep-2"].output[-6000:]
    _check_ended_in_time(jobs["sleep-2"])


def test_every_rank_names_the_stuck_rank_its_phase_and_its_stack(jobs):
    _check_names_stuck_rank_phase_and_stack(jobs["sleep-2"].output, 2, 1, "training_step", "training_step")
