"""The transients of one training step: what it allocates beyond the model state and the saved activations.

The fake copy of the module (``_activations.py``: one rank's shapes) runs one steady-state training step under
torch's ``MemTracker`` (``torch.distributed._tools``): its optimizer (the module's own ``configure_optimizers``) holds
its state already, then forward, backward, ``step`` and ``zero_grad``. At the step's peak the tracker's snapshot says
what was alive by kind: the temporaries (an activation's gradient, an op's workspace, a recomputed checkpointed
block, the optimizer's foreach buffers), the share of the gradients and the activations still held. A
layout's peak is then its own state and activations at those shares plus the temporaries (``plan.py``).
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StepPeak", "in_child", "step_peak"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepPeak:
    """What one step holds at its peak beyond the state, as bytes and shares of one rank's whole."""

    #: bytes of temporaries alive at the peak
    temporaries: float
    #: share of the gradients alive at the peak (0 before the backward made any, 1 in the optimizer step)
    grads: float
    #: bytes of the forward's activations still alive at the peak
    activations: float


def _loss(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def _with_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state allocated (one step on zero gradients), as it is from the second step on."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_peak(shadow: pl.LightningModule, batch: Any, optimizer: torch.optim.Optimizer) -> StepPeak:
    """The peak of one training step of ``shadow`` (fake parameters) on ``batch`` (fake), under the active fake mode.

    ``optimizer``: the module's optimizer over ``shadow``'s parameters.
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    _with_state(optimizer)
    tracker = MemTracker()
    tracker.track_external(shadow, optimizer)
    with tracker, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)` but the `self\.trainer` reference")
        loss = _loss(shadow.training_step(batch, 0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    grads_total = sum(p.numel() * p.element_size() for p in shadow.parameters() if p.requires_grad)
    return StepPeak(
        temporaries=float(peak.get(_MemRefType.TEMP, 0)),
        grads=min(1.0, peak.get(_MemRefType.GRAD, 0) / grads_total) if grads_total else 0.0,
        activations=float(peak.get(_MemRefType.ACT, 0)),
    )


def in_child(work: Callable[[], T]) -> T:
    """``work()`` run in a forked child, its (picklable) result sent back (here where ``os.fork`` is missing).

    Fake tensors (which live on the meta device) leave the autograd engine counting a device: a fake backward, or
    this process's next real one, starts its device threads, after which no forked child of this process can run
    autograd (Lightning's ``fork`` start methods, the strategies' ``*_fork`` names). The child takes that with it.
    """
    if not hasattr(os, "fork"):
        return work()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        try:
            # the parent's OpenMP pool does not survive a fork (the engine's threads would assert on it); fake
            # tensors compute nothing, so one thread is all the child needs
            torch.set_num_threads(1)
            payload = pickle.dumps(("ok", work()))
        except BaseException as error:
            payload = pickle.dumps(("error", f"{type(error).__name__}: {error}"))
        with os.fdopen(write, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as source:
        data = source.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("lit_accel.plan: its process measuring the layouts died. Fix: report it, with its stderr.")
    status, value = pickle.loads(data)
    if status == "error":
        raise RuntimeError(f"lit_accel.plan: measuring the layouts failed: {value}")
    return value
