"""``DynamicGradScaler``: torch's ``GradScaler`` with hysteresis, scale bounds and on-device counters.

The update policy is DeepSpeed's (``runtime/fp16/loss_scaler.py``, ``consecutive_hysteresis=True``) and Megatron-LM's
(``optimizer/grad_scaler.py``), as tensor ops with no host sync; the rules and what stays on the host:
docs/precision.md ("Loss scaling", "Host syncs per optimizer step").
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lit_accel.protocols import ScalerStats
from lit_accel.utilities import _compat, _workarounds
from lit_accel.utilities._validation import check_bool, check_int, check_number

__all__ = ["DynamicGradScaler", "ScalerStats"]

# Integer state, one int64 device vector in this order (``state_dict()`` keys). ``first_min_scale_hit`` is the
# optimizer step index (0-based) of the first min-scale hit, -1 while there was none.
_COUNTERS = (
    "overflow_streak",
    "skipped_steps",
    "growths",
    "backoffs",
    "min_scale_hits",
    "steps",
    "first_min_scale_hit",
)
_INITIAL = [0, 0, 0, 0, 0, 0, -1]


class DynamicGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, ``min_scale``/``max_scale`` and on-device counters.

    Pass it to ``AccelPrecision("16-mixed", scaler=...)``, which places it on the Trainer's device, or use it in a raw
    loop or any ``MixedPrecision(scaler=...)``: without ``device`` its tensors are created at the first ``scale()``, on
    the loss's device, as torch's are. It is the ``ScalerStatsProvider`` the ``LossScaleMonitor`` reads.

    Args:
        device: where the scale and counters live; ``None`` decides at ``to(device)`` or the first ``scale()``.
        init_scale, growth_factor, backoff_factor, growth_interval: as torch's (``growth_factor > 1``,
            ``backoff_factor`` in (0, 1)).
        hysteresis: consecutive overflowing steps tolerated (skipped) before the scale backs off; 1 is torch's rule.
        min_scale, max_scale: the scale's bounds; an overflow at ``min_scale`` counts as a min-scale hit.
        dynamic: ``False`` keeps the scale at ``init_scale``; overflowing steps are still skipped and counted.

    Raises:
        ValueError: a setting out of range. TypeError: a setting of the wrong type.
        RuntimeError: ``device`` is CUDA on a machine without CUDA.

    Example::

        plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2**12, hysteresis=2))
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
    ) -> None:
        _validate(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, dynamic)
        _compat.check_grad_scaler_skip_hook()
        target = None if device is None else torch.device(device)
        super().__init__("cpu" if target is None else target.type, init_scale, growth_factor, backoff_factor,
                         growth_interval, enabled=True)  # fmt: skip
        if not self.is_enabled():  # torch disables a "cuda" scaler when CUDA is unavailable (it warned)
            raise RuntimeError(f"DynamicGradScaler(device={device!r}): CUDA is not available. Fix: pass device=None.")
        self.hysteresis = hysteresis
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.dynamic = dynamic
        self._static_scale = float(init_scale)
        self._home: torch.device | None = None
        self._counts = torch.tensor(_INITIAL)  # on the host until the device is known (loaded counts wait here)
        self._true: Tensor | None = None  # a constant, so that one stack adds every increment
        self._grad_scale: Tensor | None = None
        # Tracker and streak followed on the host (None: unknown after a fused step); clean steps not written yet.
        self._host_tracker: int | None = 0
        self._host_streak: int | None = 0
        self._unwritten_steps = self._unwritten_tracker = 0
        # The scale may change at these versions; _grad_scale holds version ..._copied, the last backward used ..._used.
        self._scale_version = self._grad_scale_copied = self._grad_scale_used = 0
        if target is not None:
            self.to(target)

    def to(self, device: str | torch.device) -> DynamicGradScaler:
        """Create the scale and counters on ``device`` now, or move them there (one host read when moving)."""
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if self._home == target:
            return self
        state = self.state_dict() if self._home is not None else None
        _compat.reset_grad_scaler_tensors(self, target.type)
        _compat.init_grad_scaler_tensors(self, target)
        self._home = target
        self._counts = self._counts.to(target)
        self._true = torch.ones((), dtype=torch.bool, device=target)
        self._grad_scale = self._scale_tensor().clone()
        if state is not None:
            self.load_state_dict(state)
        return self

    @property
    def device(self) -> torch.device | None:
        """The device of the scale and the counters (``None`` until they exist)."""
        return self._home

    def _require(self, what: str) -> None:
        if self._home is None:
            raise RuntimeError(
                f"DynamicGradScaler.{what}(): the scaler has no device yet. Fix: call scaler.to(device) first, or let"
                " AccelPrecision set it up (during fit)."
            )

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __getstate__ drops the scale and tracker tensors (keeping their values); recreate them here
        # (ddp_spawn pickles the plugin into its workers).
        super().__setstate__(state)
        if self._home is not None:
            _compat.init_grad_scaler_tensors(self, self._home)
            self._grad_scale = self._scale_tensor().clone()
            self._grad_scale_copied = self._scale_version

    @override
    def __getstate__(self) -> dict[str, Any]:
        self._write_pending()  # torch's reads the device tracker (after copying __dict__)
        return super().__getstate__()

    def _write_pending(self) -> None:
        """Write the clean steps kept on the host into the device counters and tracker (two ops at most)."""
        if self._unwritten_steps:
            self._counts[5].add_(self._unwritten_steps)
        if self._unwritten_tracker:
            self._tracker_tensor().add_(self._unwritten_tracker)
        self._unwritten_steps = self._unwritten_tracker = 0

    @override
    def _get_growth_tracker(self) -> int:
        self._write_pending()  # nothing is pending before the device exists
        return super()._get_growth_tracker()

    @override
    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` by the current scale, and remember it as the scale of the gradients they produce."""
        if self._home is None and isinstance(outputs, Tensor):
            self.to(outputs.device)
        self._require("scale")
        assert self._grad_scale is not None
        if self._grad_scale_copied != self._scale_version:
            self._grad_scale.copy_(self._scale_tensor())  # one tiny device copy, no sync
            self._grad_scale_copied = self._scale_version
        self._grad_scale_used = self._scale_version
        return super().scale(outputs)

    def _at_backward_scale(self) -> AbstractContextManager[None]:
        """The scale the gradients were computed with, in place of the current one if an ``update()`` ran since."""
        if self._grad_scale_used == self._scale_version:
            return nullcontext()  # the usual case
        return _workarounds.unscale_with_backward_scale(self, self._grad_scale)

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale they were computed with (torch divides by the current scale)."""
        self._require("unscale_")
        with self._at_backward_scale():
            super().unscale_(optimizer)

    @override
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``, unscaling (or handing fused kernels) the scale the gradients were computed with."""
        self._require("step")
        with self._at_backward_scale():
            return super().step(optimizer, *args, **kwargs)

    def _scale_tensor(self) -> Tensor:
        scale = _compat.grad_scaler_scale(self)
        assert scale is not None
        return scale

    def _tracker_tensor(self) -> Tensor:
        tracker = _compat.grad_scaler_growth_tracker(self)
        assert tracker is not None
        return tracker

    @override
    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # torch's version reads the found-inf flags with .item() and steps unless one is set; doing the same here
        # keeps that (unavoidable) host value with the iteration's state, so callers learn about the skip without a
        # second sync (``_compat.grad_scaler_step_skipped``); update() forgets it with the rest.
        skipped = bool(sum(flag.item() for flag in _compat.optimizer_state_found_infs(optimizer_state)))
        optimizer_state[_compat.HOST_FOUND_INF] = skipped
        return None if skipped else optimizer.step(*args, **kwargs)

    @override
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Apply the policy (docs/precision.md, "Loss scaling") to the flags recorded since the last update.

        ``new_scale`` sets the scale by hand (torch's behaviour) and leaves every counter unchanged.
        """
        self._require("update")
        if new_scale is not None:
            super().update(new_scale)
            self._scale_version += 1
            return
        overflow_on_host = _compat.grad_scaler_host_found_inf(self)
        if self._clean_step_on_host(overflow_on_host):
            _compat.reset_grad_scaler_iteration(self)
            return
        self._write_pending()
        self._scale_version += 1
        self._follow_on_host(overflow_on_host)
        scale = self._scale_tensor()
        flags = [flag.to(scale.device) for flag in _compat.grad_scaler_found_infs(self)]
        if not flags:
            raise RuntimeError("DynamicGradScaler.update(): no inf checks were recorded since the last update.")
        overflow = (flags[0] if len(flags) == 1 else torch.stack(flags).sum()) > 0
        old = scale.clone()
        if self.dynamic and self.hysteresis == 1:
            super().update()  # torch's own rule, one kernel (and the end of the iteration); then the bounds
            scale.clamp_(self.min_scale, self.max_scale)
            backoff = overflow
        else:
            backoff = self._hysteresis_policy(overflow, scale)
            _compat.reset_grad_scaler_iteration(self)
        c = self._counts  # overflow_streak, skipped_steps, growths, backoffs, min_scale_hits, steps, first hit
        hit = backoff & (old <= self.min_scale)
        torch.where(hit & (c[6] < 0), c[5], c[6], out=c[6])
        c[1:6].add_(torch.stack((overflow, scale > old, scale < old, hit, self._true)))  # type: ignore[arg-type]

    def _clean_step_on_host(self, overflow: bool | None) -> bool:
        """A clean step that resets no streak and grows nothing: counted on the host (no tensor op)."""
        tracker = self._host_tracker
        if overflow is not False or self._host_streak != 0 or tracker is None:
            return False
        if self.dynamic:
            if tracker + 1 >= self._growth_interval:
                return False  # a growth is due: the device decides (it is clamped to max_scale there)
            self._host_tracker, self._unwritten_tracker = tracker + 1, self._unwritten_tracker + 1
        self._unwritten_steps += 1
        return True

    def _follow_on_host(self, overflow: bool | None) -> None:
        """The tracker and streak after this update, as the device will compute them (``None`` once unknown)."""
        tracker, streak = self._host_tracker, self._host_streak
        if overflow is None or tracker is None or streak is None:
            self._host_tracker = self._host_streak = None
            return
        if self.dynamic:
            grows = not overflow and tracker + 1 >= self._growth_interval
            self._host_tracker = 0 if overflow or grows else tracker + 1
        backs_off = self.dynamic and streak + 1 >= self.hysteresis
        self._host_streak = 0 if not overflow or self.hysteresis == 1 or backs_off else streak + 1

    def _hysteresis_policy(self, overflow: Tensor, scale: Tensor) -> Tensor:
        """Scale, tracker and streak after a step (``hysteresis > 1``, static scaling); returns whether it backs off."""
        tracker, streak = self._tracker_tensor(), self._counts[0]
        streak_next = torch.where(overflow, streak + 1, 0)
        if not self.dynamic:
            streak.copy_(streak_next)
            return torch.zeros_like(overflow)
        backoff = overflow & (streak_next >= self.hysteresis)
        tracker_next = torch.where(overflow, 0, tracker + 1)
        grow = tracker_next >= self._growth_interval
        grown = torch.where(grow, (scale * self._growth_factor).clamp_(max=self.max_scale), scale)
        scale.copy_(torch.where(backoff, (scale * self._backoff_factor).clamp_(min=self.min_scale), grown))
        tracker.copy_(torch.where(grow, 0, tracker_next))
        streak.copy_(torch.where(backoff, 0, streak_next))
        return backoff

    @property
    def scale_version(self) -> int:
        """Grows whenever the scale may have changed; equal across a clean step that grew nothing (no op ran)."""
        return self._scale_version

    @property
    def loss_scaling(self) -> bool:
        """Always True: a ``DynamicGradScaler`` cannot be disabled (the ``ScalerStatsProvider`` protocol)."""
        return True

    def scaler_stats(self) -> ScalerStats:
        """Snapshot of scale and counters as 0-d device tensors (no host sync): what ``LossScaleMonitor`` reads."""
        self._require("scaler_stats")
        self._write_pending()
        c = self._counts.clone()
        return ScalerStats(self._scale_tensor().detach().clone(), self._tracker_tensor().to(torch.int64), *c[:4])

    def read_min_scale_state(self) -> tuple[float, int, int]:
        """``(scale, min_scale_hits, step of the first hit or -1)`` as Python numbers: one host sync."""
        self._require("read_min_scale_state")
        self._write_pending()
        # float64 holds the int64 counters exactly below 2**53.
        values = torch.cat((self._scale_tensor().double().view(1), self._counts[4:7:2].double())).tolist()
        return values[0], int(values[1]), int(values[2])

    def counter(self, name: str) -> Tensor:
        """One 0-d int64 counter on the device (``overflow_streak`` ... ``steps``, see ``state_dict``), as of now.

        A view: it follows later overflows and growths; ``steps`` is written at reads (clean steps wait on the host).
        """
        self._require("counter")
        self._write_pending()
        return self._counts[_COUNTERS.index(name)]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The entries of torch's scaler plus settings, streak and every counter, as Python numbers (syncs)."""
        self._write_pending()
        settings = {name: getattr(self, name) for name in ("hysteresis", "min_scale", "max_scale", "dynamic")}
        return {**super().state_dict(), **dict(zip(_COUNTERS, self._counts.tolist())), **settings}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (or a plain ``torch.amp.GradScaler``'s; missing counters are 0).

        The constructor's settings win over the saved ones, and the scale is clamped into ``[min_scale, max_scale]``.
        """
        settings = (self._growth_factor, self._backoff_factor, self._growth_interval)
        super().load_state_dict(state_dict)
        self._growth_factor, self._backoff_factor, self._growth_interval = settings
        scale = min(max(float(state_dict["scale"]), self.min_scale), self.max_scale)
        self._init_scale = scale if self.dynamic else self._static_scale  # a static scale is a setting, not state
        counts = [int(state_dict.get(name, initial)) for name, initial in zip(_COUNTERS, _INITIAL)]
        self._counts.copy_(torch.tensor(counts))  # a host copy until the device is known
        self._unwritten_steps = self._unwritten_tracker = 0  # replaced by the loaded state
        self._host_tracker, self._host_streak = int(state_dict["_growth_tracker"]), counts[0]
        self._scale_version += 1
        if self._home is not None:
            assert self._grad_scale is not None
            self._scale_tensor().fill_(self._init_scale)
            self._grad_scale.fill_(self._init_scale)
            self._grad_scale_copied = self._scale_version


def _validate(init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int,
              min_scale: float, max_scale: float, dynamic: bool) -> None:  # fmt: skip
    """The one place the scaler's settings are checked; every message names the value and the fix."""
    owner = "DynamicGradScaler"
    check_number(owner, "init_scale", init_scale, fix="pass init_scale=65536.0 (2**16, the usual start)")
    check_number(owner, "growth_factor", growth_factor, fix="pass growth_factor=2.0")
    check_number(owner, "backoff_factor", backoff_factor, fix="pass backoff_factor=0.5")
    check_number(owner, "min_scale", min_scale, fix="pass min_scale=1.0")
    check_number(owner, "max_scale", max_scale, fix="pass max_scale=16777216.0 (2**24)")
    check_int(owner, "growth_interval", growth_interval, example=2000)
    check_int(owner, "hysteresis", hysteresis, example=2)
    check_bool(owner, "dynamic", dynamic)
    if growth_factor <= 1:
        raise ValueError(
            f"{owner}(growth_factor={growth_factor!r}): must be > 1. Fix: pass growth_factor=2.0, or dynamic=False."
        )
    if not backoff_factor < 1:
        raise ValueError(f"{owner}(backoff_factor={backoff_factor!r}): must be in (0, 1). Fix: pass 0.5.")
    if min_scale > init_scale:
        raise ValueError(
            f"{owner}(min_scale={min_scale!r}, init_scale={init_scale!r}): min_scale must be <= init_scale. Fix: pass"
            f" min_scale={init_scale!r} or a larger init_scale."
        )
    if max_scale < init_scale:  # (check_number refused a non-finite one)
        raise ValueError(
            f"{owner}(max_scale={max_scale!r}, init_scale={init_scale!r}): max_scale must be >= init_scale. Fix: pass"
            f" max_scale={max(init_scale, 2.0**24)!r}."
        )
