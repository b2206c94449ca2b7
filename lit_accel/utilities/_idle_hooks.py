"""Callback hooks without work, left out of Lightning's per-step dispatch.

Lightning calls every per-step hook of every callback, each inside a profiler context (``_call_callback_hooks`` in
``lightning/pytorch/trainer/call.py``), whether the hook does anything or not: a few microseconds per hook per step,
10-20 per callback (``benchmarks/host_cost.py``, arm ``ddp_callback``). It skips a hook that is not callable, so a
callback sets a hook it has no work for to ``None`` on the instance (:func:`idle`) and puts the method back when
there is work again (:func:`wake`). Only a hook that still is the given class's own is touched: a subclass that
overrides it keeps it. ``tests/utilities/test_idle_hooks.py`` fails if Lightning stops skipping such hooks.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

__all__ = ["PER_STEP_HOOKS", "idle", "idle_unused", "wake"]

#: The callback hooks Lightning calls at every training batch (automatic optimization).
PER_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def idle(callback: Callback, owner: type, *names: str) -> None:
    """Let Lightning skip the hooks ``names`` of ``callback`` while they are ``owner``'s own (not overridden)."""
    for name in names:
        if getattr(type(callback), name) is getattr(owner, name):
            setattr(callback, name, None)


def wake(callback: Callback, *names: str) -> None:
    """Undo :func:`idle`: Lightning calls these hooks again."""
    for name in names:
        callback.__dict__.pop(name, None)


def idle_unused(callback: Callback) -> None:
    """Idle the per-step hooks that nobody overrides (``Callback``'s own no-ops): for a callback's ``__init__``."""
    idle(callback, Callback, *PER_STEP_HOOKS)
