"""Every fix lit_accel applies to upstream behaviour, fenced: issue link, affected versions, and a loud test.

Each entry of :data:`WORKAROUNDS` names the upstream bug, the package and the versions it is known to affect (a PEP 440
specifier; open-ended while unfixed), and the test in ``tests/utilities/test_workarounds.py`` that reproduces the bug
on plain upstream code. When an upgrade fixes it, that test fails naming the entry: narrow its range to the broken
versions, and the fix switches itself off on fixed ones (:func:`applies`). Access to private attributes stays in
``_compat.py``; this module holds behaviour.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lit_accel.utilities import _compat

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lit_accel.protocols import SkippedStepRecord

__all__ = [
    "WORKAROUNDS",
    "SkipAwareScheduler",
    "Workaround",
    "applies",
    "check_static_graph_accumulation",
    "rescale_partial_window_",
    "resume_finished_epoch",
    "resume_loader_states",
    "skip_aware_schedulers",
    "unscale_with_backward_scale",
]


@dataclass(frozen=True)
class Workaround:
    """One upstream behaviour lit_accel corrects: where it is reported and which versions have it."""

    package: str
    affected: str
    issue: str
    summary: str

    def applies(self) -> bool:
        """Whether the installed ``package`` is in the affected range (pre-releases included)."""
        return _in_range(self.package, self.affected)


WORKAROUNDS: dict[str, Workaround] = {
    "partial_window": Workaround(
        "lightning",
        ">=2.0",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/19987",
        "the last, partial accumulation window of an epoch is divided by the full accumulation count",
    ),
    "skip_aware_schedulers": Workaround(
        "lightning",
        ">=2.0",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/5558",
        "step-interval LR schedulers advance on optimizer steps the loss scaler skipped (also #18828, #21339)",
    ),
    "finished_epoch_resume": Workaround(
        "lightning",
        ">=2.4",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/19617",
        "with max_steps, resuming from an end-of-epoch checkpoint trains one spurious batch (also #19815)",
    ),
    "loader_states_after_early_setup": Workaround(
        "lightning",
        ">=2.0",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/20550",
        "resumable loader states are dropped when the train dataloader was set up before the checkpoint's loops",
    ),
    "backward_scale_unscale": Workaround(
        "torch",
        ">=2.3",
        "https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers",
        "GradScaler unscales with the current scale, wrong after an update between a backward and a later step",
    ),
    "comm_hooks_on_cpu": Workaround(
        "lightning",
        ">=2.0",
        "https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.0/src/lightning/pytorch/strategies/ddp.py",
        "DDPStrategy registers DDP comm hooks only on CUDA, silently ignoring them on CPU/gloo",
    ),
    "static_graph_no_sync": Workaround(
        "torch",
        ">=2.4",
        "https://github.com/pytorch/pytorch/issues/143580",
        "DDP(static_graph=True) whose first backward runs under no_sync() fails an internal reducer assertion",
    ),
}


@cache  # asked on every fp16 step (unscale_with_backward_scale): parsing the range each time took ~60 us
def _in_range(package: str, affected: str) -> bool:
    installed = _installed(package)
    return installed is not None and SpecifierSet(affected).contains(installed, prereleases=True)


@cache
def _installed(package: str) -> Version | None:
    try:
        return Version(version(package))
    except PackageNotFoundError:
        return None


def applies(name: str) -> bool:
    """Whether the workaround ``name`` of :data:`WORKAROUNDS` is needed with the installed packages."""
    return WORKAROUNDS[name].applies()


# ---------------------------------------------------------------------- Lightning #19987: the partial window


def rescale_partial_window_(params: Iterable[torch.Tensor], accumulation: int, micro_batches: int) -> None:
    """Turn a short window's gradient from Lightning's ``sum / k`` into the mean over its ``m`` micro-batches.

    One fused ``_foreach_mul_`` by ``k / m``, once per epoch. The factor is linear, so it commutes with DDP's
    all-reduce mean, FSDP's reduce-scatter and a loss scaler's scale (an inf stays an inf).
    """
    if not applies("partial_window") or not 0 < micro_batches < accumulation:
        return
    grads = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
    if grads:
        torch._foreach_mul_(grads, accumulation / micro_batches)


# ---------------------------------------------------------------------- Lightning #5558: skip-aware schedulers


class SkipAwareScheduler:
    """A step-interval LR scheduler that holds still after a skipped optimizer step; the rest is ``scheduler``'s.

    Lightning steps every step-interval scheduler after each optimizer step, skipped or not; this wrapper asks
    ``record.step_was_skipped(optimizer)`` first. ``state_dict()``/``load_state_dict()`` are the scheduler's own, so
    checkpoints are those of plain Lightning; every other attribute is read from the user's ``scheduler``.
    """

    def __init__(self, scheduler: Any, record: SkippedStepRecord) -> None:
        self.scheduler = scheduler
        self.record = record

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.record.step_was_skipped(getattr(self.scheduler, "optimizer", None)):
            return None  # the optimizer did not step: neither does the schedule
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:  # optimizer, get_last_lr(), base_lrs, last_epoch, ...
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def skip_aware_schedulers(configs: list[LRSchedulerConfig], record: SkippedStepRecord) -> list[LRSchedulerConfig]:
    """``configs`` with every step-interval scheduler wrapped in a :class:`SkipAwareScheduler` that asks ``record``.

    Call it where the schedulers are handed over (``Precision.connect``, or a callback's ``on_fit_start``).
    """
    if not applies("skip_aware_schedulers"):
        return configs
    return [
        replace(config, scheduler=SkipAwareScheduler(config.scheduler, record))
        if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler)
        else config
        for config in configs
    ]


# ---------------------------------------------------------------------- Lightning #19617: finished-epoch resume


def resume_finished_epoch(trainer: Any) -> bool:
    """After the loops are restored: a checkpoint taken after an epoch's last batch resumes at the next epoch.

    With ``max_steps`` set, Lightning keeps the fit loop "restarting" after any load, and a restored finished epoch
    then trains one spurious batch (index ``num_batches``, data of batch 0). With ``max_epochs`` only it takes its
    exact path; clearing the flag makes ``max_steps`` runs take the same one. Call it from the strategy's
    ``load_optimizer_state_dict`` (the first strategy hook after the loops are restored). Returns whether it acted.
    """
    if not applies("finished_epoch_resume"):
        return False
    return _compat.clear_finished_epoch_restart(trainer)


def resume_loader_states(trainer: Any) -> bool:
    """After the loops are restored: load a resumable train loader's saved state when it was set up earlier.

    A strategy that plans the batch before ``configure_optimizers`` sets up the train dataloader in its ``setup``, as
    ``estimated_stepping_batches`` does, before Lightning restores the loops; Lightning then never loads the loader's
    saved state. Call it from the strategy's ``load_optimizer_state_dict``, after :func:`resume_finished_epoch`.
    Returns whether it acted.
    """
    if not applies("loader_states_after_early_setup"):
        return False
    return _compat.load_pending_loader_states(trainer)


# ---------------------------------------------------------------------- torch: unscale with the backward's scale


@contextlib.contextmanager
def unscale_with_backward_scale(scaler: torch.amp.GradScaler, scale: torch.Tensor | None) -> Iterator[None]:
    """Let ``GradScaler.unscale_``/``step`` divide by ``scale`` (the backward's) instead of the current scale.

    They differ when an ``update()`` ran between a backward and another optimizer's step fed by it: Lightning
    updates after every optimizer, torch's recipe once per iteration.
    """
    if scale is None or not applies("backward_scale_unscale"):
        yield
        return
    with _compat.grad_scaler_scale_swapped(scaler, scale):
        yield


# ---------------------------------------------------------------------- torch: static_graph + no_sync


def check_static_graph_accumulation(owner: str, static_graph: bool, accumulation: int) -> None:
    """Refuse ``static_graph=True`` with accumulation: Lightning's first micro-batch runs under ``no_sync()``.

    Raises:
        ValueError: both are set on an affected torch.
    """
    if static_graph and accumulation > 1 and applies("static_graph_no_sync"):
        raise ValueError(
            f"{owner}(static_graph=True) cannot be combined with gradient accumulation (accumulate_grad_batches="
            f"{accumulation}): DDP's static graph fails under the no_sync() of non-final micro-batches. Fix: pass"
            " static_graph=False."
        )
