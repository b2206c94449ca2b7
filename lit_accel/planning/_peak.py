"""The transients of one training step: what it allocates beyond the model state and the saved activations.

The fake copy of the module (``_activations.py``: one rank's shapes) runs one steady-state training step: its
optimizer (the module's own ``configure_optimizers``) holds its state already, then forward, backward, ``step`` and
``zero_grad``, every storage an op makes counted by kind until it dies (``_Alive``): made in the forward, an
activation; after it, a temporary (an activation's gradient, an op's workspace, a recomputed checkpointed block, the
optimizer's buffers) until it becomes a parameter's gradient. At the largest total it says what was alive: the
temporaries, the share of the gradients and the activations still held. A layout's peak is then its own state and
activations at those shares plus the temporaries (``plan.py``). (torch's ``MemTracker`` counts the same, equal to
the byte on the test models, but updates every module's peak at every op: 13x slower on a 7B model.)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Moment", "StepPeak", "in_children", "step_peak"]

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class Moment:
    """What one moment of a step holds beyond the state, as bytes and shares of one rank's whole."""

    #: bytes of temporaries alive
    temporaries: float
    #: share of the gradients alive (0 before the backward made any, 1 in the optimizer step)
    grads: float
    #: bytes of the forward's activations still alive
    activations: float


@dataclass(frozen=True)
class StepPeak:
    """A step's largest moment while it computes (forward and backward) and while its optimizer updates.

    Apart because FSDP's gathered parameters are alive only in the first: a layout's peak is the larger of the two.
    """

    compute: Moment
    update: Moment


def _loss(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def _with_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state allocated (one step on zero gradients), as it is from the second step on."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Alive(TorchDispatchMode):
    """The bytes of the storages ops make, alive by kind, and their split at each phase's largest total.

    A storage is counted once (views share it) and uncounted when it dies; storages known before (``known``: the
    model's state, the batch) are never counted.
    """

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.kind = "activations"
        #: "compute" (forward and backward) or "update" (the optimizer): each has its own largest moment
        self.phase = "compute"
        self.alive = {"activations": 0, "temporaries": 0, "grads": 0, "known": 0}
        self.total = 0
        self.peaks = {"compute": (0, dict(self.alive)), "update": (0, dict(self.alive))}
        self._kinds: dict[int, tuple[str, int]] = {}
        for tensor in known:
            self.track(tensor, "known")

    def _gone(self, key: int) -> None:
        kind, size = self._kinds.pop(key)
        self.alive[kind] -= size
        self.total -= size

    def track(self, tensor: torch.Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)  # its entry leaves when it dies (below), before the id can be reused
        if key in self._kinds:
            old, size = self._kinds[key]
            if kind == "grads" and old != "known":  # a temporary the backward made became a gradient
                self._kinds[key] = (kind, size)
                self.alive[old] -= size
                self.alive[kind] += size
            return
        size = 0 if kind == "known" else storage.nbytes()
        self._kinds[key] = (kind, size)
        weakref.finalize(storage, self._gone, key)
        self.alive[kind] += size
        self.total += size
        if self.total > self.peaks[self.phase][0]:
            self.peaks[self.phase] = (self.total, dict(self.alive))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor, self.kind)
        return out


def step_peak(shadow: pl.LightningModule, batch: Any, optimizer: torch.optim.Optimizer,
              watch: contextlib.AbstractContextManager | None = None) -> StepPeak:  # fmt: skip
    """The peak of one training step of ``shadow`` (fake parameters) on ``batch`` (fake), under the active fake mode.

    ``optimizer``: the module's optimizer over ``shadow``'s parameters. ``watch``: entered around the forward.
    """
    _with_state(optimizer)
    params = [p for p in shadow.parameters() if p.requires_grad]
    states = [v for state in optimizer.state.values() for v in state.values()]
    known = [t for t in (*shadow.parameters(), *shadow.buffers(), *tree_leaves(batch), *states)
             if isinstance(t, torch.Tensor)]  # fmt: skip
    alive = _Alive(known)
    handles = [p.register_post_accumulate_grad_hook(lambda p: alive.track(p.grad, "grads")) for p in params]
    try:
        with alive, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)` but the `self\.trainer` reference")
            with watch or contextlib.nullcontext():
                loss = _loss(shadow.training_step(batch, 0))
            alive.kind = "temporaries"
            loss.backward()
            alive.phase = "update"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    grads_total = sum(p.numel() * p.element_size() for p in params)

    def moment(phase: str) -> Moment:
        at = alive.peaks[phase][1]
        share = min(1.0, at["grads"] / grads_total) if grads_total else 0.0
        return Moment(float(at["temporaries"]), share, float(at["activations"]))

    return StepPeak(moment("compute"), moment("update"))


def in_children(work: Callable[[K], T], items: Sequence[K]) -> list[T]:
    """``[work(item) for item in items]`` run in forked children, one per core, their (picklable) results sent back.

    Fake tensors (which live on the meta device) leave the autograd engine counting a device: a fake backward, or
    this process's next real one, starts its device threads, after which no forked child of this process can run
    autograd (Lightning's ``fork`` start methods, the strategies' ``*_fork`` names). The children take that with them.
    Here where ``os.fork`` is missing, the work runs in this process.
    """
    if not hasattr(os, "fork"):
        return [work(item) for item in items]
    workers = max(1, min(len(items), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    children = [_fork(lambda share=share: [work(item) for item in share]) for share in
                (items[start::workers] for start in range(workers))]  # fmt: skip
    replies = [_collect(*child) for child in children]  # every child waited for, before any failure is raised
    shares = []
    for status, value in replies:
        if status != "ok":
            raise RuntimeError(f"lit_accel.plan: measuring the layouts failed: {value}")
        shares.append(value)
    results: list[T] = [None] * len(items)  # type: ignore[list-item]
    for start, share in enumerate(shares):
        results[start::workers] = share
    return results


def _fork(work: Callable[[], T]) -> tuple[int, int]:
    """``(pid, read end)`` of a forked child that runs ``work()`` and writes its pickled result."""
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
    return pid, read


def _collect(pid: int, read: int) -> tuple[str, Any]:
    """The child's ``(status, result or error)``, once it has exited."""
    with os.fdopen(read, "rb") as source:
        data = source.read()
    os.waitpid(pid, 0)
    if not data:
        return "died", "its process died (Fix: report it, with its stderr)"
    return pickle.loads(data)
