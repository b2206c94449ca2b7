"""``DynamicGradScaler``: torch's ``GradScaler`` with hysteresis, scale bounds and on-device counters.

The update policy is the one DeepSpeed (``runtime/fp16/loss_scaler.py``, ``DynamicLossScaler`` with
``consecutive_hysteresis=True``) and Megatron-LM (``optimizer/grad_scaler.py``) use for large fp16 runs, written as a
handful of tensor ops so that it needs no host sync:

* overflow (inf/NaN in any gradient): the step is skipped, the growth tracker resets, and the overflow streak grows;
  when the streak reaches ``hysteresis`` the scale is multiplied by ``backoff_factor`` (never below ``min_scale``)
  and the streak resets. An overflow while the scale is already at ``min_scale`` is a *min-scale hit*: counted, so
  the caller can stop instead of skipping forever (DeepSpeed raises there).
* clean step: the streak resets; after ``growth_interval`` consecutive clean steps the scale is multiplied by
  ``growth_factor`` (never above ``max_scale``). With ``hysteresis=1`` and unbounded scale this is exactly torch's
  ``torch._amp_update_scale_``.

``dynamic=False`` is static loss scaling: the scale never changes, overflowing steps are still skipped and counted.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from typing_extensions import override

from lit_accel.utilities import _compat

__all__ = ["DynamicGradScaler", "ScalerStats", "validate_scaler_args"]

# Integer state kept as int64 0-d device tensors, in this order in ``state_dict()``.
_COUNTERS = ("overflow_streak", "skipped_steps", "growths", "backoffs", "min_scale_hits", "steps")


class ScalerStats(NamedTuple):
    """0-d device tensors describing the scaler after the last ``update()``; reading them needs no host sync.

    ``scale`` is float32, the rest int64. Stack them and call ``.tolist()`` once, at logging steps only.
    """

    scale: Tensor
    growth_tracker: Tensor
    overflow_streak: Tensor
    skipped_steps: Tensor
    growths: Tensor
    backoffs: Tensor


def validate_scaler_args(
    owner: str,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``owner``, the bad value, what is allowed and the usual choice."""

    def number(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{owner}({name}={value!r}): expected a number.")
        if not math.isfinite(value):
            raise ValueError(f"{owner}({name}={value!r}): expected a finite number.")
        return float(value)

    def integer(name: str, value: Any, default: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}({name}={value!r}): expected an int such as {default}.")
        if value < 1:
            raise ValueError(f"{owner}({name}={value!r}): expected an int >= 1, such as {default} (the default).")

    if number("init_scale", init_scale) <= 0:
        raise ValueError(
            f"{owner}(init_scale={init_scale!r}): the loss scale must be > 0; the usual start is 2**16 = 65536."
        )
    if number("growth_factor", growth_factor) <= 1:
        raise ValueError(
            f"{owner}(growth_factor={growth_factor!r}): must be > 1 (it multiplies the scale after growth_interval"
            " clean steps); the usual value is 2.0. For a scale that never changes pass dynamic=False."
        )
    if not 0 < number("backoff_factor", backoff_factor) < 1:
        raise ValueError(
            f"{owner}(backoff_factor={backoff_factor!r}): must be in (0, 1) (it multiplies the scale after an"
            " overflow); the usual value is 0.5."
        )
    integer("growth_interval", growth_interval, 2000)
    integer("hysteresis", hysteresis, 1)
    if number("min_scale", min_scale) <= 0:
        raise ValueError(f"{owner}(min_scale={min_scale!r}): must be > 0, such as 1.0 (the default).")
    if min_scale > init_scale:
        raise ValueError(
            f"{owner}(min_scale={min_scale!r}, init_scale={init_scale!r}): min_scale must be <= init_scale; lower"
            f" min_scale (e.g. min_scale={init_scale!r}) or raise init_scale."
        )
    if number("max_scale", max_scale) < init_scale:
        raise ValueError(
            f"{owner}(max_scale={max_scale!r}, init_scale={init_scale!r}): max_scale must be >= init_scale; raise"
            " max_scale (default 2**24) or lower init_scale."
        )


class DynamicGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, ``min_scale``/``max_scale`` and on-device counters.

    Unlike torch's scaler, its tensors are created at construction on ``device`` (not at the first ``scale()``),
    and ``load_state_dict`` restores *state* (scale, growth tracker, streak, counters) but keeps the constructor's
    *settings* (factors, intervals, bounds): resuming with a lower ``min_scale`` is how a run that stopped at the
    minimum continues. A loaded scale is clamped into ``[min_scale, max_scale]``.

    Args:
        device: where the scale and counters live (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``).
        init_scale: initial loss scale.
        growth_factor: scale multiplier after ``growth_interval`` consecutive clean steps (> 1).
        backoff_factor: scale multiplier after ``hysteresis`` consecutive overflows (in (0, 1)).
        growth_interval: consecutive clean steps before the scale grows.
        hysteresis: consecutive overflowing steps tolerated (skipped) before the scale backs off.
        min_scale: the scale never backs off below this; an overflow at it counts as a min-scale hit.
        max_scale: the scale never grows above this (so it cannot grow to inf in a run that never overflows).
        dynamic: ``False`` keeps the scale at ``init_scale`` (static loss scaling); overflowing steps are still
            skipped and counted.

    Raises:
        ValueError: an argument is out of range (see ``validate_scaler_args``).
        RuntimeError: the installed torch lacks the private ``GradScaler`` hook this class relies on.

    Example::

        scaler = DynamicGradScaler("cuda", hysteresis=2)
        trainer = Trainer(plugins=[AccelPrecision("16-mixed", hysteresis=2)])  # builds one like this in setup
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
    ) -> None:
        validate_scaler_args(
            type(self).__name__,
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )
        _compat.check_grad_scaler_skip_hook()
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(dev.type, init_scale, growth_factor, backoff_factor, growth_interval, enabled=True)
        if not self.is_enabled():  # torch disables a "cuda" scaler when CUDA is unavailable (it warned)
            raise RuntimeError(f"{type(self).__name__}(device={device!r}): CUDA is not available on this machine.")
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = dynamic
        self._static_scale = float(init_scale)
        self._home = dev
        _compat.init_grad_scaler_tensors(self, dev)
        self._counters = {name: torch.zeros((), dtype=torch.int64, device=dev) for name in _COUNTERS}
        # Optimizer step index (0-based) of the first min-scale hit, -1 while there was none.
        self._first_min_scale_hit = torch.full((), -1, dtype=torch.int64, device=dev)
        # Per optimizer (by id): was its last step skipped? A host bool when ``_maybe_opt_step`` read the flag anyway
        # (non-fused optimizers), else the 0-d device flag (fused optimizers, which skip on the device).
        self._host_skipped: dict[int, bool] = {}
        self._last_skipped: dict[int, bool | Tensor] = {}
        # The scale the current gradients were multiplied by: the scale at the last ``scale()``. It differs from the
        # current scale when an ``update()`` ran between a backward and the step of another optimizer fed by it.
        self._grad_scale = self._scale_tensor().clone()

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __getstate__ drops the scale and tracker tensors (keeping their values); recreate them, since this
        # class relies on having them from construction (ddp_spawn pickles the plugin into its workers).
        super().__setstate__(state)
        _compat.init_grad_scaler_tensors(self, self._home)
        self._grad_scale = self._scale_tensor().clone()

    @override
    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` by the current scale, and remember it as the scale of the gradients they produce."""
        self._grad_scale.copy_(self._scale_tensor())  # one tiny device copy, no sync
        return super().scale(outputs)

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale they were computed with (torch divides by the current scale).

        The two differ only when the scale was updated after the backward, which happens with several optimizers on
        one backward (manual optimization: ``opt1.step(); opt2.step()``, each followed by an update).
        """
        with _compat.grad_scaler_scale_swapped(self, self._grad_scale):
            super().unscale_(optimizer)

    @override
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``, unscaling (or handing fused kernels) the scale the gradients were computed with."""
        with _compat.grad_scaler_scale_swapped(self, self._grad_scale):
            return super().step(optimizer, *args, **kwargs)

    @property
    def device(self) -> torch.device:
        """The device of the scale and the counters."""
        return self._scale_tensor().device

    def _scale_tensor(self) -> Tensor:
        scale = _compat.grad_scaler_scale(self)
        assert scale is not None  # created in __init__
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
        # keeps that (unavoidable) host value, so callers learn about skips without a second sync.
        skipped = bool(sum(flag.item() for flag in _compat.optimizer_state_found_infs(optimizer_state)))
        self._host_skipped[id(optimizer)] = skipped
        return None if skipped else optimizer.step(*args, **kwargs)

    @override
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Apply the policy of the module docstring to the flags recorded since the last update.

        ``new_scale`` sets the scale by hand (torch's behaviour) and leaves every counter unchanged.
        """
        if new_scale is not None:
            super().update(new_scale)
            self._host_skipped.clear()
            return
        scale, tracker = self._scale_tensor(), self._tracker_tensor()
        per_optimizer = _compat.grad_scaler_found_infs(self)
        if not any(per_optimizer.values()):
            raise RuntimeError(f"{type(self).__name__}.update(): no inf checks were recorded since the last update.")
        total: Tensor | None = None
        self._last_skipped = {}
        for key, flags in per_optimizer.items():
            if not flags:
                continue
            flag = flags[0] if len(flags) == 1 else torch.stack([f.to(scale.device) for f in flags]).sum()
            self._last_skipped[key] = self._host_skipped.get(key, flag)
            total = flag.to(scale.device) if total is None else total + flag.to(scale.device)
        self._host_skipped.clear()
        assert total is not None
        self._apply_policy(total > 0, scale, tracker)
        _compat.reset_grad_scaler_iteration(self)

    def _apply_policy(self, overflow: Tensor, scale: Tensor, tracker: Tensor) -> None:
        c = self._counters
        streak = torch.where(overflow, c["overflow_streak"] + 1, 0)
        c["skipped_steps"].add_(overflow)
        if self.dynamic:
            backoff = overflow & (streak >= self.hysteresis)
            hit = backoff & (scale <= self.min_scale)
            tracker_next = torch.where(overflow, 0, tracker + 1)
            grow = tracker_next >= self._growth_interval
            new_scale = torch.where(
                backoff,
                (scale * self._backoff_factor).clamp_(min=self.min_scale),
                torch.where(grow, (scale * self._growth_factor).clamp_(max=self.max_scale), scale),
            )
            c["growths"].add_(new_scale > scale)
            c["backoffs"].add_(new_scale < scale)
            c["min_scale_hits"].add_(hit)
            first = self._first_min_scale_hit
            first.copy_(torch.where(hit & (first < 0), c["steps"], first))
            tracker.copy_(torch.where(grow, 0, tracker_next))
            streak = torch.where(backoff, 0, streak)
            scale.copy_(new_scale)
        c["overflow_streak"].copy_(streak)
        c["steps"].add_(1)

    def host_skipped(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether the optimizer's step since the last ``update()`` was skipped, when known on the host for free.

        Known for non-fused optimizers (``step()`` read the found-inf flag); ``None`` for fused ones and before a step.
        """
        return self._host_skipped.get(id(optimizer))

    def last_step_skipped(self, optimizer: torch.optim.Optimizer) -> bool | Tensor | None:
        """Whether the optimizer's last step was skipped: a host bool when known for free, else a 0-d device flag.

        ``None`` before its first step. Turning a device flag into a bool (``bool(flag)``) is a host sync.
        """
        return self._last_skipped.get(id(optimizer))

    def stats(self) -> ScalerStats:
        """Snapshot of scale and counters as 0-d device tensors (no host sync)."""
        c = self._counters
        return ScalerStats(
            scale=self._scale_tensor().detach().clone(),
            growth_tracker=self._tracker_tensor().to(torch.int64),
            overflow_streak=c["overflow_streak"].clone(),
            skipped_steps=c["skipped_steps"].clone(),
            growths=c["growths"].clone(),
            backoffs=c["backoffs"].clone(),
        )

    def read_min_scale_state(self) -> tuple[float, int, int]:
        """``(scale, min_scale_hits, step of the first hit or -1)`` as Python numbers: one host sync."""
        c = self._counters
        # float64 holds the int64 counters exactly below 2**53.
        values = torch.stack(
            [self._scale_tensor().double(), c["min_scale_hits"].double(), self._first_min_scale_hit.double()]
        ).tolist()
        return values[0], int(values[1]), int(values[2])

    def counter(self, name: str) -> Tensor:
        """One live 0-d int64 counter on the device.

        ``overflow_streak``, ``skipped_steps``, ``growths``, ``backoffs``, ``min_scale_hits`` or ``steps``.
        """
        return self._counters[name]

    @override
    def state_dict(self) -> dict[str, Any]:
        """The entries of torch's scaler plus settings, streak and every counter, as Python numbers (syncs)."""
        state = super().state_dict()
        values = torch.stack([*self._counters.values(), self._first_min_scale_hit]).tolist()
        state.update(zip(_COUNTERS, values))
        state["first_min_scale_hit"] = values[-1]
        state.update(hysteresis=self.hysteresis, min_scale=self.min_scale, max_scale=self.max_scale)
        state["dynamic"] = self.dynamic
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state from ``state_dict()`` (or from a plain ``torch.amp.GradScaler``; missing counters are 0).

        The constructor's settings win over the saved ones, and the scale is clamped into ``[min_scale, max_scale]``.
        """
        settings = (self._growth_factor, self._backoff_factor, self._growth_interval)
        super().load_state_dict(state_dict)
        self._growth_factor, self._backoff_factor, self._growth_interval = settings
        scale = min(max(float(state_dict["scale"]), self.min_scale), self.max_scale)
        if not self.dynamic:
            scale = self._static_scale  # a static scale is a setting, not state
        self._scale_tensor().fill_(scale)
        self._grad_scale.fill_(scale)
        self._init_scale = scale
        for name in _COUNTERS:
            self._counters[name].fill_(int(state_dict.get(name, 0)))
        self._first_min_scale_hit.fill_(int(state_dict.get("first_min_scale_hit", -1)))
