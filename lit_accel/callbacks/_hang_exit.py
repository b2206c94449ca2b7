"""How a rank that found a hang writes its report and ends: fd-2 writes, thread dumps, child processes, exit.

Everything here runs on the watchdog thread while the main thread is stuck, possibly holding Python-level locks
(``sys.stderr``'s buffer, a logging handler): nothing may wait on those without a bound.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from lit_accel.callbacks._stack_inspection import all_thread_stacks

__all__ = ["DUMP_SIGNAL", "dump_threads", "end_process", "register_dump_signal", "write_stderr"]

# DataLoader workers forked after registration inherit faulthandler's handler for this signal: they dump their stacks.
DUMP_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None


def write_stderr(text: str) -> None:
    """Write to file descriptor 2 directly: no Python-level lock that a stuck main thread could be holding.

    One ``write`` per line: a pipe shared by several ranks (Lightning's popen launcher) keeps writes below
    ``PIPE_BUF`` whole, so the ranks' reports interleave by line, not within one.
    """
    with contextlib.suppress(OSError):
        for line in text.splitlines(keepends=True):
            data = line.encode(errors="replace")
            while data:
                data = data[os.write(2, data) :]


def _flush_stdio(timeout_s: float = 1.0) -> None:
    """Flush Python's stdout/stderr buffers, giving up after ``timeout_s`` if a stuck thread holds their lock."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    thread = threading.Thread(target=flush, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread": out of memory, the case a hang often comes with; exit unflushed
        return
    thread.join(timeout_s)


def register_dump_signal() -> int | None:
    """Install faulthandler's all-threads dump on :data:`DUMP_SIGNAL` if nobody uses it; the signal, or None.

    Only the main thread may install signal handlers; the caller must ``faulthandler.unregister`` it when done.
    """
    if DUMP_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return None
    with contextlib.suppress(ValueError, OSError, RuntimeError):
        if signal.getsignal(DUMP_SIGNAL) == signal.SIG_DFL:
            faulthandler.register(DUMP_SIGNAL, file=2, all_threads=True, chain=False)
            return DUMP_SIGNAL
    return None


def dump_threads(prefix: str, dump_signal: int | None) -> None:
    """Dump every thread of this process to fd 2, then ask each child process (DataLoader worker) to dump its own."""
    write_stderr(f"{prefix}HangWatchdog: all threads of this rank (pid {os.getpid()}), most recent call first:\n")
    try:
        faulthandler.dump_traceback(file=2, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        write_stderr(all_thread_stacks() + "\n")
    if dump_signal is None:
        return
    for worker in multiprocessing.active_children():
        write_stderr(f"{prefix}HangWatchdog: stacks of child process {worker.name} (pid {worker.pid}):\n")
        with contextlib.suppress(OSError, TypeError):
            os.kill(worker.pid, dump_signal)
            time.sleep(0.2)  # let it write before the next one starts


def end_process(exit_code: int, launched: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Stop the child processes, flush, and ``os._exit(exit_code)``.

    DataLoader workers are killed (a blocked one would outlive us); the ranks this process launched get ``grace_s``
    to exit by themselves, then are killed.
    """
    for worker in multiprocessing.active_children():
        with contextlib.suppress(OSError, TypeError):
            os.kill(worker.pid, signal.SIGKILL)
    for proc in launched:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
    _flush_stdio()
    os._exit(exit_code)
