"""``StepOutcomes``: what ``AccelPrecision`` learns after each optimizer step, and what it does about it.

After ``GradScaler.step`` the plugin must know, cheaply, whether the step was skipped: step-interval LR schedulers
must not move on a skipped step, a loss scale stuck at ``min_scale`` must stop the run with an explanation, and the
bf16/fp32 non-finite guard must raise naming the bad step. This module keeps that bookkeeping, the host-side part of
it (the scaler's own counters stay on the device).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lit_accel.utilities._lagged_flags import LaggedFlags

if TYPE_CHECKING:
    from lit_accel.plugins.grad_scaler import DynamicGradScaler

__all__ = ["StepOutcomes", "Where"]

_HISTORY = 8  # overflow steps kept for the min-scale error message

#: (global step, batch index) of an optimizer step, taken when it ran.
Where = tuple[int, int]


def where_text(at: Where) -> str:
    """``"optimizer step S (batch_idx B)"``: how every message names a step."""
    return f"optimizer step {at[0]} (batch_idx {at[1]})"


class StepOutcomes:
    """Skip flags, min-scale stop and non-finite errors, for one ``AccelPrecision``.

    Args:
        owner: the plugin's class name, for messages.
        precision: the plugin's precision string, for messages.
        on_min_scale: ``"raise"`` or ``"warn"`` when an overflow happens at ``min_scale``.
        on_nonfinite: the guard's policy, ``"raise"`` or ``"skip"``.
        min_scale_check_interval: with fused optimizers, read the min-scale counter every this many steps.

    Example::

        outcomes = StepOutcomes("AccelPrecision", "16-mixed", "raise", "raise", 100)
        scaler.step(optimizer)
        scaler.update()
        outcomes.stepped(scaler, optimizer, is_guard=False, at=(trainer.global_step, batch_idx))
    """

    def __init__(
        self,
        owner: str,
        precision: str,
        on_min_scale: Literal["raise", "warn"],
        on_nonfinite: Literal["raise", "skip", "off"],
        min_scale_check_interval: int,
    ) -> None:
        self.owner, self.precision = owner, precision
        self.on_min_scale, self.on_nonfinite = on_min_scale, on_nonfinite
        self.min_scale_check_interval = min_scale_check_interval
        #: ids of optimizers with step-interval schedulers (``None``: a scheduler whose optimizer is unknown).
        self.scheduled: set[int | None] = set()
        self.skipped_on_host: dict[int, bool] = {}
        self.history: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (step, scale after it) at overflows
        self.hits_seen = 0
        self.warned_min_scale = False
        self._steps_since_check = 0
        # Fused optimizers + guard + on_nonfinite="raise": the kernel already skipped the bad step on the device, so
        # the flag is read two steps later, when its copy has reached the host, instead of stalling every step.
        self._lagged_nonfinite = LaggedFlags(lag=1)

    # ------------------------------------------------------------------ per step

    def stepped(self, scaler: DynamicGradScaler, optimizer: Optimizer, is_guard: bool, at: Where) -> None:
        """After ``scaler.update()``: learn whether the step was skipped when that is free or needed, and act on it.

        Raises:
            RuntimeError: the guard found non-finite gradients (``on_nonfinite="raise"``), or the scale is at
                ``min_scale`` and still overflows (``on_min_scale="raise"``).
        """
        key = id(optimizer)
        skipped = scaler.last_step_skipped(optimizer)
        if isinstance(skipped, Tensor):  # fused optimizer: the flag is on the device
            needs_host = key in self.scheduled or None in self.scheduled
            if is_guard and self.on_nonfinite == "raise" and not needs_host:
                self._lagged_nonfinite.push(skipped, tag=at)
                return
            skipped = bool(skipped.item()) if needs_host else None  # the documented sync of these configurations
        if skipped is not None:
            self.skipped_on_host[key] = skipped
        if is_guard:
            if skipped and self.on_nonfinite == "raise":
                raise RuntimeError(self.nonfinite_message(at))
            return
        if skipped:
            self._check_min_scale(scaler, at)
        elif skipped is None and scaler.dynamic:
            self._steps_since_check += 1
            if self._steps_since_check >= self.min_scale_check_interval:
                self._steps_since_check = 0
                self._check_min_scale(scaler, at, periodic=True)

    def not_stepped(self, optimizer: Optimizer) -> None:
        """The optimizer had nothing to step (no backward, no gradients): not a skip, schedulers move as usual."""
        self.skipped_on_host[id(optimizer)] = False

    def should_skip_scheduler(self, optimizer: Optimizer | None) -> bool:
        """Whether the last step of ``optimizer`` (any optimizer for ``None``) was skipped."""
        if optimizer is None:
            return any(self.skipped_on_host.values())
        return self.skipped_on_host.get(id(optimizer), False)

    def raise_lagged_nonfinite(self, wait: bool = False) -> None:
        """Raise for a fused step whose non-finite flag has become due (every queued flag with ``wait``)."""
        at = self._lagged_nonfinite.first_set(wait=wait)
        if at is not None:
            self._lagged_nonfinite.clear()
            raise RuntimeError(self.nonfinite_message(at))

    def reset(self) -> None:
        """Forget what only this fit needs (queued flags)."""
        self._lagged_nonfinite.clear()

    # ------------------------------------------------------------------ min scale

    def _check_min_scale(self, scaler: DynamicGradScaler, at: Where, periodic: bool = False) -> None:
        scale, hits, first_hit = scaler.read_min_scale_state()  # one sync, on overflow steps only
        if not periodic or hits > self.hits_seen:
            self.history.append((at[0], scale))
        if hits <= self.hits_seen:
            return
        self.hits_seen = hits
        message = self.min_scale_message(scaler.min_scale, first_hit, at, periodic)
        if self.on_min_scale == "raise":
            raise RuntimeError(message)
        if not self.warned_min_scale:
            self.warned_min_scale = True
            rank_zero_warn(message + " Continuing (on_min_scale='warn').")

    # ------------------------------------------------------------------ messages

    def min_scale_message(self, min_scale: float, first_hit: int, at: Where, periodic: bool) -> str:
        history = ", ".join(f"step {step}: {value:g}" for step, value in self.history) or "none recorded"
        checked = f" (fused optimizer: checked every {self.min_scale_check_interval} steps)" if periodic else ""
        return (
            f"{self.owner}('16-mixed'): the loss scale is at min_scale={min_scale:g} and gradients still overflow at"
            f" {where_text(at)}{checked}, so every step is skipped (first overflow at the minimum: optimizer step"
            f" {first_hit}; scale after recent overflows: {history}). Fix: use 'bf16-mixed', lower the learning rate"
            " or add warm-up/clipping, check the data for inf/NaN, or lower min_scale or pass on_min_scale='warn'."
        )

    def nonfinite_message(self, at: Where) -> str:
        return (
            f"{self.owner}({self.precision!r}): non-finite gradients (inf/NaN) at {where_text(at)}; the step was"
            " skipped, the weights are finite. Fix: lower the learning rate or add warm-up/clipping, check this batch"
            " for inf/NaN, or pass on_nonfinite='skip'."
        )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The host-side history of overflows and min-scale hits (the scaler's counters are saved with it)."""
        return {
            "history": [list(entry) for entry in self.history],
            "min_scale_hits_seen": self.hits_seen,
            "warned_min_scale": self.warned_min_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(((int(s), float(v)) for s, v in state.get("history", [])), maxlen=_HISTORY)
        self.hits_seen = int(state.get("min_scale_hits_seen", 0))
        self.warned_min_scale = bool(state.get("warned_min_scale", False))
