"""A configuration error found on the ranks, said once: rank 0 prints its message on one line, the others nothing.

Some settings can only be checked once the processes run (the loader's batch size, the world size under torchrun).
Every rank then raises the same ``ValueError``, and each prints its traceback, prefixed ``[rankN]:`` by torch's
process-group excepthook: with two ranks the one sentence that matters sits at the end of ~90 lines, twice.
:func:`say_once` is called from a strategy's ``on_exception`` with the exception on its way out: when it is one of
lit_accel's configuration errors (a ``ValueError``/``TypeError`` raised in this package, whose message carries a
``Fix:``) it installs an excepthook for that one exception object, so that rank 0 prints ``ValueError: <message>``
and the other ranks exit without a word. Any other exception, and the same one caught by the user, are untouched.
"""

from __future__ import annotations

import sys
from types import TracebackType

from lit_accel.utilities._warnings import is_lit_accel_path

__all__ = ["is_configuration_error", "say_once"]


def is_configuration_error(exception: BaseException) -> bool:
    """A ``ValueError``/``TypeError`` raised in lit_accel's own code whose message says ``Fix:``."""
    if not isinstance(exception, ValueError | TypeError) or "Fix:" not in str(exception):
        return False
    tb = exception.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and is_lit_accel_path(tb.tb_frame.f_code.co_filename)


def say_once(exception: BaseException, rank: int, world_size: int) -> None:
    """If ``exception`` is a configuration error of a multi-process run, print it once (rank 0) when it ends the run."""
    if world_size < 2 or not is_configuration_error(exception):
        return
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if value is not exception:
            previous(kind, value, tb)
        elif rank == 0:
            sys.stderr.write(f"{kind.__name__}: {' '.join(str(value).split())}\n")
            sys.stderr.flush()

    sys.excepthook = excepthook
