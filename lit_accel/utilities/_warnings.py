"""lit_accel's warnings on the console: one line each, from rank 0 only, without Python's source-line echo.

Python prints a warning as ``path:line: Category: message`` followed by the source line that raised it; for a warning
raised inside lit_accel that line is our own plumbing (``self._warn(``), which tells the user nothing. Lightning
formats its own warnings without it (``lightning/fabric/utilities/warnings.py``); :func:`install` does the same for
warnings whose frame lies in this package, by wrapping ``warnings.formatwarning`` once at import. Filters,
``pytest.warns`` and ``-W error`` see the same warnings as before: only the printed text changes.

:func:`rank_zero_warn` is the default ``warn`` of the meters (no Lightning import there): a warning from every rank of
an 8-process job would print eight times.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch.distributed as dist

__all__ = ["format_warning", "install", "is_lit_accel_path", "rank_zero_warn"]

_PACKAGE = str(Path(__file__).resolve().parents[1])
_installed = False


def is_lit_accel_path(filename: str) -> bool:
    """Whether ``filename`` is a module of this package (not a user's file that merely mentions it)."""
    try:
        return str(Path(filename).resolve()).startswith(_PACKAGE + os.sep)
    except (OSError, ValueError):
        return False


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int) -> str:
    """``UserWarning: <message>`` on one line (the message already names the class and the fix)."""
    return f"{category.__name__}: {' '.join(str(message).split())}\n"


def install() -> None:
    """Wrap ``warnings.formatwarning`` (idempotent) so lit_accel's own warnings print as :func:`format_warning`."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = warnings.formatwarning

    def formatwarning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        if is_lit_accel_path(filename):
            return format_warning(message, category, filename, lineno)
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # The variables Lightning's rank_zero_only reads, in its order.
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def rank_zero_warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` on global rank 0 only, attributed to the caller's frame."""
    if _rank() == 0:
        warnings.warn(message, category, stacklevel=2)
