"""Where a thread is, read from its Python frames: in a collective, in autograd's backward, or running code.

A rank whose peer is stuck blocks inside a collective (``torch.distributed.*``, DDP's buffer broadcast) or inside
autograd's C++ engine, where DDP's reducer waits for the gradient all-reduce. A rank stuck in its own code (a sleep,
a lock, a dataloader queue, a synchronising call waiting for a GPU) is anywhere else. The watchdog thread of each rank
inspects its own main thread with ``sys._current_frames()`` and publishes the result.

Source lines are never read: on a hung filesystem ``linecache`` would block the very thread that must report it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import FrameType
from typing import Literal, NamedTuple

import torch

__all__ = ["Location", "all_thread_stacks", "format_stack", "inspect_thread"]

Kind = Literal["running", "collective", "backward", "debugger", "gone"]


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def _dirs(*keys: str) -> set[str]:
    return {_norm(path) + os.sep for key in keys if (path := sysconfig.get_path(key))}


_TORCH = _norm(os.path.dirname(torch.__file__)) + os.sep
_LIT_ACCEL = _norm(os.path.dirname(os.path.dirname(__file__))) + os.sep
_SITE = tuple(_dirs("purelib", "platlib"))
_STDLIB = tuple(_dirs("stdlib", "platstdlib"))  # in a virtualenv, platstdlib is the parent of site-packages
# Installed packages and the standard library are not "your code" (nor are lit_accel's own files).
_LIBRARY = tuple(sorted(_dirs("stdlib", "platstdlib", "purelib", "platlib") | {_TORCH, _LIT_ACCEL}, key=len)[::-1])
_C10D = _TORCH + os.path.join("distributed", "distributed_c10d.py")
_COLLECTIVE_FILES = frozenset(
    {
        _C10D,
        _TORCH + os.path.join("distributed", "_functional_collectives.py"),
        _TORCH + os.path.join("distributed", "nn", "functional.py"),
        _TORCH + os.path.join("nn", "parallel", "distributed.py"),  # DDP's buffer broadcast and bucket rebuild
    }
)
_DISTRIBUTED = _TORCH + "distributed" + os.sep
_AUTOGRAD = _TORCH + "autograd" + os.sep
_BACKWARD_FUNCTIONS = frozenset({"_engine_run_backward", "backward", "grad"})
_DEBUGGER_FILES = ("bdb.py", "pdb.py")


class Location(NamedTuple):
    """What a thread is doing, as its rank publishes it.

    ``call`` is the innermost frame's function (``torch.distributed.all_reduce`` for a collective), ``site`` the
    innermost frame outside torch and the standard library (the call site into torch: user code or Lightning's loop),
    ``user`` the innermost frame of the user's own code (outside every installed package). Frames are written
    ``"path:line in qualname"``; any of them may be None.
    """

    kind: Kind
    call: str | None
    site: str | None
    user: str | None


def _qualname(frame: FrameType) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python >= 3.11


def _short(path: str) -> str:
    """``path`` relative to the package root or working directory it is under, else unchanged."""
    normed = _norm(path)
    for root in (*_LIBRARY, _norm(os.getcwd()) + os.sep):
        if normed.startswith(root):
            return os.path.relpath(normed, root)
    return path


def _where(frame: FrameType) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {_qualname(frame)}"


def _is_library(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    return filename.startswith("<") or _norm(filename).startswith(_LIBRARY)


def _is_torch_or_stdlib(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith("<"):
        return True
    normed = _norm(filename)
    return normed.startswith(_TORCH) or (normed.startswith(_STDLIB) and not normed.startswith(_SITE))


def _call_label(frame: FrameType) -> str:
    normed = _norm(frame.f_code.co_filename)
    if normed == _C10D:
        return f"torch.distributed.{frame.f_code.co_name}"
    if normed.startswith(_TORCH) and normed.endswith(".py"):
        module = os.path.relpath(normed[: -len(".py")], os.path.dirname(_TORCH.rstrip(os.sep)))
        return f"{module.replace(os.sep, '.')}.{_qualname(frame)}"
    return _where(frame)


def _frames(frame: FrameType | None) -> list[FrameType]:
    """The frames from ``frame`` outwards: innermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def inspect_thread(thread_id: int) -> tuple[Location, FrameType | None]:
    """Classify the thread ``thread_id`` by its current frames; ``kind="gone"`` if it no longer runs."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return Location("gone", None, None, None), None
    frames = _frames(frame)
    if any(f.f_trace is not None or f.f_code.co_filename.endswith(_DEBUGGER_FILES) for f in frames):
        return Location("debugger", _call_label(frames[0]), None, None), frame
    site = next((_where(f) for f in frames if not _is_torch_or_stdlib(f)), None)
    user = next((_where(f) for f in frames if not _is_library(f)), None)
    # The innermost run of library frames: what the thread executes on behalf of its caller.
    block = []
    for f in frames:
        if not _is_library(f):
            break
        block.append((f, _norm(f.f_code.co_filename)))
    collective = [f for f, name in block if name in _COLLECTIVE_FILES]
    if collective or (block and block[0][1].startswith(_DISTRIBUTED)):
        return Location("collective", _call_label(collective[0] if collective else frames[0]), site, user), frame
    if any(name.startswith(_AUTOGRAD) and f.f_code.co_name in _BACKWARD_FUNCTIONS for f, name in block):
        return Location("backward", "autograd backward", site, user), frame
    # Generic stdlib frames (selectors, threading) say little: name the innermost torch frame if there is one
    # (``torch.utils.data.dataloader...._try_get_data``: the main process waits for a DataLoader worker).
    label = next((f for f, name in block if name.startswith(_TORCH)), frames[0])
    return Location("running", _call_label(label), site, user), frame


def format_stack(frame: FrameType | None, limit: int = 60) -> str:
    """``traceback``-style lines (most recent call last) without source text: the innermost ``limit`` frames."""
    frames = _frames(frame)[:limit]
    return "\n".join(f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {_qualname(f)}' for f in frames[::-1])


def all_thread_stacks() -> str:
    """Every thread's stack with its name (what ``faulthandler`` prints, for a stderr without a file descriptor)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"Thread {names.get(ident, '?')} ({ident:#x}), most recent call last:\n{format_stack(frame)}"
        for ident, frame in sys._current_frames().items()
    )
