"""Explain a collective error caused by a peer process that died, naming the rank and how it ended.

When one rank of a DDP job raises or is killed, its sockets close and every surviving rank fails in its next
collective with a transport error such as gloo's ``Connection closed by peer`` or ``Connection reset by peer`` (seconds,
not the 30-minute collective timeout). That error names an address, not a rank, and a rank killed with SIGKILL (the
out-of-memory killer, a scheduler) prints nothing at all, so the job's log does not say what happened. Rank 0 of a job
started by Lightning's subprocess launcher (``strategy="accel_ddp"`` without torchrun/SLURM) holds the ``Popen``
handles of the other local ranks, so it can say which one ended and with which exit code or signal.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

__all__ = ["explain_peer_failure", "is_peer_loss"]

# Transport errors of a collective whose peer went away: gloo (tcp/pair.cc) and NCCL.
_PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|NCCL communicator was aborted",
    re.IGNORECASE,
)
# How long rank 0 waits, in total, for its dead or dying child ranks to be reaped before describing them. A killed
# child is reaped at once; a child that raised is usually still printing its traceback for a moment.
_WAIT_S = 3.0


def is_peer_loss(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective's transport error that a peer process ending would cause."""
    return bool(_PEER_LOST.search(str(exception)))


def _describe(rank: int, proc: subprocess.Popen, deadline: float) -> str:
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return f"rank {rank} (PID {proc.pid}) is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} (PID {proc.pid}) was killed by {name}"
    return f"rank {rank} (PID {proc.pid}) exited with code {code}"


def peer_failure_note(world_size: int, children: list[tuple[int, subprocess.Popen]], wait_s: float = _WAIT_S) -> str:
    """The explanation appended to the error: what the local child ranks did, and where to look.

    Args:
        world_size: processes in the job.
        children: ``(global rank, Popen)`` of the ranks this process launched (empty when launched externally).
        wait_s: total seconds to wait for the children to be reaped.
    """
    head = (
        f"lit_accel: this collective failed because another process of the {world_size}-process job stopped; this"
        " error is a consequence, not the cause."
    )
    deadline = time.monotonic() + wait_s
    statuses = [_describe(rank, proc, deadline) for rank, proc in children]
    if statuses:
        head += " Ranks launched by this process: " + "; ".join(statuses) + "."
    # Without an ended child to point at, both hints apply (the culprit may be on another node, or under torchrun).
    unknown = not any("still running" not in status for status in statuses)
    if unknown or any("killed by" in status for status in statuses):
        head += (
            " A process killed by a signal prints nothing: SIGKILL usually comes from the out-of-memory killer"
            " (check `dmesg` or the scheduler's log)."
        )
    if unknown or any("exited with code" in status for status in statuses):
        head += " A rank that raised prints its own traceback, prefixed with its rank: look for the first one."
    return head


def explain_peer_failure(
    exception: BaseException, world_size: int, children: list[tuple[int, subprocess.Popen]], wait_s: float = _WAIT_S
) -> bool:
    """Append :func:`peer_failure_note` to ``exception``'s message if it is a peer-loss error; True if it did.

    Only the first argument is changed, and only when it is a string (as Lightning's ``_augment_message`` does), so
    the exception keeps its type and traceback. Never raises.
    """
    if world_size < 2 or not exception.args or not isinstance(exception.args[0], str) or not is_peer_loss(exception):
        return False
    try:
        note = peer_failure_note(world_size, children, wait_s)
    except Exception:  # an explanation must never replace the real error
        return False
    exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])
    return True
