"""``MinScaleStop``: an fp16 run whose loss scale is stuck at ``min_scale`` stops with an explanation.

Without it, every step after a *min-scale hit* would be skipped (DeepSpeed raises there, Megatron-LM clamps). When the
hit counter is read on the host: docs/precision.md, "Host syncs per optimizer step".
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lit_accel.plugins.grad_scaler import DynamicGradScaler
from lit_accel.utilities import _compat
from lit_accel.utilities._validation import check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MinScaleStop"]

_HISTORY = 8  # overflow steps kept for the message


class MinScaleStop:
    """What ``AccelPrecision`` does when the loss scale is at ``min_scale`` and gradients still overflow.

    Args:
        owner: the plugin's class name, for messages.
        action: ``"raise"`` (stop the fit) or ``"warn"`` once and keep skipping.
        check_interval: with fused optimizers, read the hit counter every this many optimizer steps.
    """

    def __init__(self, owner: str, action: Literal["raise", "warn"], check_interval: int) -> None:
        check_choice(owner, "on_min_scale", action, ("raise", "warn"), "'raise'")
        check_int(owner, "min_scale_check_interval", check_interval, example=100)
        self.owner, self.action, self.check_interval = owner, action, check_interval
        self.history: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (step, scale after it) at overflows
        self.hits_seen = 0
        self.warned = False
        self._unchecked_steps = 0

    def after_update(self, scaler: Any, skipped: bool | Tensor, trainer: pl.Trainer) -> None:
        """After ``scaler.update()``; ``skipped`` is the step's skip flag (a device flag: not known on the host).

        Raises:
            RuntimeError: the scale is at ``min_scale`` and still overflows (``action="raise"``).
        """
        if not isinstance(scaler, DynamicGradScaler):  # torch's GradScaler has no min_scale
            return
        if skipped is True:
            self._check(scaler, trainer, periodic=False)
        elif isinstance(skipped, Tensor) and scaler.dynamic:
            self._unchecked_steps += 1
            if self._unchecked_steps >= self.check_interval:
                self._unchecked_steps = 0
                self._check(scaler, trainer, periodic=True)

    def _check(self, scaler: DynamicGradScaler, trainer: pl.Trainer, periodic: bool) -> None:
        scale, hits, first_hit = scaler.read_min_scale_state()  # one sync, on overflow (or periodic) steps only
        step = trainer.global_step
        if not periodic or hits > self.hits_seen:
            self.history.append((step, scale))
        if hits <= self.hits_seen:
            return
        self.hits_seen = hits
        history = ", ".join(f"step {s}: {value:g}" for s, value in self.history)
        checked = f" (fused optimizer: checked every {self.check_interval} steps)" if periodic else ""
        message = (
            f"{self.owner}('16-mixed'): the loss scale is at min_scale={scaler.min_scale:g} and gradients still"
            f" overflow at optimizer step {step} (batch_idx {_compat.train_batch_idx(trainer)}){checked}, so every"
            f" step is skipped (first overflow at the minimum: optimizer step {first_hit}; scale after recent"
            f" overflows: {history}). Fix: use 'bf16-mixed', lower the learning rate or add warm-up/clipping, check"
            " the data for inf/NaN, or lower min_scale or pass on_min_scale='warn'."
        )
        if self.action == "raise":
            raise RuntimeError(message)
        if not self.warned:
            self.warned = True
            rank_zero_warn(message + " Continuing (on_min_scale='warn').")

    def state_dict(self) -> dict[str, Any]:
        """The host-side history of overflows and hits (the scaler saves its own counters)."""
        return {"history": [list(entry) for entry in self.history], "min_scale_hits_seen": self.hits_seen,
                "warned_min_scale": self.warned}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(((int(s), float(v)) for s, v in state.get("history", [])), maxlen=_HISTORY)
        self.hits_seen = int(state.get("min_scale_hits_seen", 0))
        self.warned = bool(state.get("warned_min_scale", False))
