"""DDP communication hooks by name, their validation, and the wrapper that counts what each bucket puts on the wire.

What is counted per gradient bucket (``calls`` / ``bytes`` per rank, before the all-reduce algorithm):

* torch's ``allreduce_hook``: 1 collective, ``numel x element size`` of the bucket;
* ``"fp16"`` / ``"bf16"``: 1 collective, ``numel x 2`` (the bucket cast to 16 bits);
* ``"powersgd"``: before ``start_powerSGD_iter`` as the default; then 3 collectives (the uncompressed tensors, P and
  Q) with the element count torch's ``PowerSGDState`` itself adds to ``total_numel_after_compression``;
* a callable (or a wrapped hook): 1 collective of the bucket's uncompressed size (the wrapper cannot see inside it).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations with the real
# ``dist.GradBucket`` and ``Future[Tensor]`` types and refuses strings.
import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from lit_accel.strategies.parts._comm_stats import HookCommStats
from lit_accel.utilities._validation import check_int

__all__ = ["COMM_HOOK_NAMES", "CommHook", "CommHookName", "counting_comm_hook", "resolve_comm_hook", "validate_comm"]

CommHookName = Literal["fp16", "bf16", "powersgd"]
COMM_HOOK_NAMES: tuple[str, ...] = ("fp16", "bf16", "powersgd")
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]
_HookKind = Literal["allreduce", "fp16", "bf16", "powersgd", "custom"]


def validate_comm(owner: str, hook: object, state: object, wrapper: object, model_averaging_period: int | None) -> None:
    """Check a strategy's comm-hook arguments at construction; raise naming the value and the fix."""
    if isinstance(hook, str):
        if hook not in COMM_HOOK_NAMES:
            raise ValueError(
                f"{owner}(comm_hook={hook!r}): expected one of {', '.join(map(repr, COMM_HOOK_NAMES))}, a callable"
                " hook(state, bucket) or None. Fix: pass e.g. comm_hook='bf16', or drop it."
            )
    elif hook is not None:
        _check_callable(owner, "comm_hook", hook, "hook(state, bucket)")
    if wrapper is not None:
        _check_callable(owner, "comm_wrapper", wrapper, "wrapper(hook)")
        if hook is None:
            raise ValueError(f"{owner}(comm_wrapper=...) wraps a hook, but comm_hook is None. Fix: pass comm_hook.")
    _check_state(owner, hook, state)
    _check_averaging(owner, state, model_averaging_period)


def _check_state(owner: str, hook: object, state: object) -> None:
    if hook == "powersgd" and state is not None and not isinstance(state, powerSGD_hook.PowerSGDState):
        raise TypeError(f"{owner}(comm_hook='powersgd', comm_state={state!r}): expected a PowerSGDState or None.")
    if state is not None and not callable(hook) and hook != "powersgd":
        raise ValueError(
            f"{owner}(comm_state={type(state).__name__}(...)) needs comm_hook='powersgd' or a callable hook, got"
            f" comm_hook={hook!r}. Fix: pass the hook the state belongs to."
        )


def _check_averaging(owner: str, state: object, model_averaging_period: int | None) -> None:
    check_int(owner, "model_averaging_period", model_averaging_period, allow_none=True, example=4)
    local_sgd = isinstance(state, post_localSGD_hook.PostLocalSGDState)
    if local_sgd and model_averaging_period is None:
        raise ValueError(
            f"{owner}(comm_state=PostLocalSGDState(...)) averages models periodically. Fix: pass"
            " model_averaging_period=..., e.g. 4."
        )
    if model_averaging_period is not None and not local_sgd:
        raise ValueError(
            f"{owner}(model_averaging_period={model_averaging_period}) only applies to post-local SGD. Fix: pass"
            " comm_state=PostLocalSGDState(...) with comm_hook=post_localSGD_hook, or drop it."
        )


def _check_callable(owner: str, arg: str, fn: object, call: str) -> None:
    if not callable(fn):
        raise TypeError(f"{owner}({arg}={fn!r}): expected a callable {call}, or None.")
    try:
        inspect.signature(fn).bind(*([None] * call.count(",")), None)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{owner}({arg}={fn!r}) cannot be called as {call}: {err}. Fix: give it the signature of torch's"
            " ddp_comm_hooks (e.g. default_hooks.allreduce_hook, default_hooks.fp16_compress_wrapper)."
        ) from err


def resolve_comm_hook(
    hook: str | CommHook | None,
    state: object | None,
    wrapper: Callable[[CommHook], CommHook] | None,
    process_group: dist.ProcessGroup | None,
) -> tuple[CommHook, object | None, _HookKind]:
    """Turn the strategy's ``comm_hook``/``comm_state``/``comm_wrapper`` into ``(hook, state, kind)``.

    ``process_group`` is the DDP module's: torch's built-in hooks take it as their state (``None`` = the world), and
    a default ``PowerSGDState`` (rank 1, 1000 plain steps first) is created for it here, once the group exists.
    """
    if hook is None:
        resolved, kind = default_hooks.allreduce_hook, "allreduce"
    elif hook == "fp16":
        resolved, kind = default_hooks.fp16_compress_hook, "fp16"
    elif hook == "bf16":
        resolved, kind = default_hooks.bf16_compress_hook, "bf16"
    elif hook == "powersgd":
        resolved, kind = powerSGD_hook.powerSGD_hook, "powersgd"
        if state is None:
            state = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=1)
    else:
        assert callable(hook)
        resolved, kind = hook, "custom"
    if wrapper is not None:
        resolved, kind = wrapper(resolved), "custom"
    return resolved, state if state is not None else process_group, kind


def counting_comm_hook(hook: CommHook, kind: _HookKind, stats: HookCommStats) -> CommHook:
    """Wrap a DDP comm hook so that every bucket it reduces is counted and timed in ``stats``.

    A few Python integer operations and one ``Future.then`` per bucket, plus one callback queued on the backward pass
    per synchronised backward (it marks the end of the compute, for ``pop_exposed_s``); it never reads a device value.
    torch's ``allreduce_hook`` is run inline (its mean all-reduce on the process group, one ``then`` for both).
    """
    if kind == "allreduce":
        return _counting_allreduce(stats)

    def accel_counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        numel = buffer.numel()
        compressing = False
        numel_before = 0
        if kind == "powersgd":
            compressing = state.iter >= state.start_powerSGD_iter  # type: ignore[attr-defined]
            numel_before = state.total_numel_after_compression  # type: ignore[attr-defined]
        start = stats.start(buffer.device)
        round_ = stats.open_round(buffer.device)  # the first bucket of a backward marks the end of its compute
        fut = hook(state, bucket)
        if kind in ("fp16", "bf16"):
            calls, nbytes = 1, numel * 2
        elif compressing:
            # PowerSGD all-reduces the tensors it does not compress, then P, then Q (three collectives, issued
            # even when a list is empty); the state adds exactly their element counts while building them.
            calls = 3
            nbytes = (state.total_numel_after_compression - numel_before) * buffer.element_size()  # type: ignore[attr-defined]
        else:
            calls, nbytes = 1, numel * buffer.element_size()
        stats.calls += calls
        stats.bytes += nbytes
        return fut.then(lambda f: stats.finish(start, f, round_))

    accel_counting_hook.__qualname__ = f"accel_counting_hook({getattr(hook, '__qualname__', repr(hook))})"
    return accel_counting_hook


def _counting_allreduce(stats: HookCommStats) -> CommHook:
    """The mean all-reduce of torch's ``allreduce_hook`` (divide, then sum over the group), counted and timed.

    Written out rather than wrapped: the process group's own ``allreduce`` and a single ``then``, which records the
    end and unpacks the result, instead of ``dist.all_reduce``'s checks and a second Python callback per bucket.
    """

    def accel_counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        start = stats.start(buffer.device)
        round_ = stats.open_round(buffer.device)  # the first bucket of a backward marks the end of its compute
        buffer.div_(group.size())  # type: ignore[union-attr]
        fut = group.allreduce([buffer]).get_future()  # type: ignore[union-attr]
        stats.calls += 1
        stats.bytes += buffer.numel() * buffer.element_size()
        return fut.then(lambda f: stats.finish(start, f, round_)[0])

    accel_counting_hook.__qualname__ = "accel_counting_hook(allreduce_hook)"
    return accel_counting_hook
