"""Where :class:`~lit_accel.meters.LossScaleMeter` gets its numbers: a scaler's own counters, or derived ones.

Both sources hand out 0-d device tensors and never read them on the host; the meter stacks them and reads them once,
at logging steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_accel.protocols import ScalerStats, ScalerStatsProvider
from lit_accel.utilities._compat import grad_scaler_scale

__all__ = ["Counters", "ScaleSource", "StatsSource", "TorchScalerSource", "select_source"]


class Counters(NamedTuple):
    """0-d device tensors: current scale and cumulative skipped steps, growths, back-offs."""

    scale: Tensor
    skipped: Tensor
    growths: Tensor
    backoffs: Tensor


class StatsSource:
    """A ``ScalerStatsProvider``'s own cumulative counters (a plugin's, or a ``DynamicGradScaler``'s).

    They know about hysteresis: a tolerated overflow is a skip without a back-off.
    """

    def __init__(self, stats: Callable[[], ScalerStats], scaler: torch.amp.GradScaler | None) -> None:
        self.stats, self.scaler = stats, scaler
        self._version: int | None = None

    def start(self) -> None:
        pass

    def after_step(self) -> None:
        pass  # the counters are cumulative: nothing to do per step

    def scale_changed(self) -> bool:
        """Whether the scale may have changed since the last call: a ``DynamicGradScaler`` says (``scale_version``)."""
        version = getattr(self.scaler, "scale_version", None)
        if version is None:
            return True
        changed, self._version = version != self._version, version
        return changed

    def scale(self) -> Tensor | None:
        live = grad_scaler_scale(self.scaler) if self.scaler is not None else None  # no copy per step
        return live if live is not None else self.stats().scale

    def counters(self) -> Counters | None:
        if getattr(self.scaler, "device", True) is None:
            return None  # a DynamicGradScaler before its first .to(device) (Fabric places it later): nothing yet
        s = self.stats()
        return Counters(s.scale, s.skipped_steps, s.growths, s.backoffs)

    def state_dict(self) -> dict[str, Any]:
        return {}  # restored with the scaler's own state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TorchScalerSource:
    """Counters for a plain ``torch.amp.GradScaler`` (Lightning's ``MixedPrecision``), derived from its scale.

    torch's rule multiplies the scale by ``backoff_factor < 1`` on every overflowing (skipped) step and by
    ``growth_factor > 1`` after ``growth_interval`` clean ones, so across one optimizer step a lower scale is one skip
    and one back-off, a higher one a growth: a few tensor ops per step, no host sync (exact while the scale is a
    positive finite float32).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self._initial: float | None = None  # scale before the first step while the scaler's tensor does not exist
        self._prev: Tensor | None = None
        self._counts: Tensor | None = None  # int64 [skipped (= back-offs), growths]
        self._loaded_counts = [0, 0]

    def start(self) -> None:
        scale = grad_scaler_scale(self.scaler)
        if self._prev is None and self._initial is None:
            # No sync: before the first scaler.scale() creates the tensor, get_scale() returns the initial (or
            # checkpoint-restored) scale from a Python float.
            self._initial = self.scaler.get_scale() if scale is None else None
            self._prev = None if scale is None else scale.detach().clone()

    def after_step(self) -> None:
        scale = grad_scaler_scale(self.scaler)
        if scale is None:
            return
        if self._prev is None:
            self._prev = torch.full((), self._initial or 0.0, dtype=scale.dtype, device=scale.device)
        if self._counts is None:
            self._counts = self._new_counts(scale.device)
        self._counts += torch.stack((scale < self._prev, scale > self._prev))
        self._prev.copy_(scale)

    def scale(self) -> Tensor | None:
        return grad_scaler_scale(self.scaler)

    def scale_changed(self) -> bool:
        return True  # torch's update runs its kernels every step: nothing to save

    def counters(self) -> Counters | None:
        scale = grad_scaler_scale(self.scaler)
        if scale is None:
            return None
        counts = self._counts if self._counts is not None else self._new_counts(scale.device)
        return Counters(scale, counts[0], counts[1], counts[0])

    def _new_counts(self, device: torch.device) -> Tensor:
        # zeros + fill_ are kernels; torch.tensor(list, device=cuda) would be a synchronous host-to-device copy.
        counts = torch.zeros(2, dtype=torch.int64, device=device)
        for i, value in enumerate(self._loaded_counts):
            counts[i].fill_(value)
        return counts

    def state_dict(self) -> dict[str, Any]:
        counts = self._counts.tolist() if self._counts is not None else list(self._loaded_counts)
        prev = self._prev.item() if self._prev is not None else self._initial
        return {"prev_scale": prev, "skipped": counts[0], "growths": counts[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._initial, self._prev, self._counts = state["prev_scale"], None, None
        self._loaded_counts = [int(state["skipped"]), int(state["growths"])]


ScaleSource = StatsSource | TorchScalerSource


def select_source(owner: Any) -> tuple[ScaleSource | None, torch.amp.GradScaler | None, str]:
    """The counter source for a precision plugin (or a bare scaler), its GradScaler, and why there is none.

    A ``ScalerStatsProvider`` (the plugin itself, or its ``scaler``: a ``DynamicGradScaler``) gives its own counters;
    a plain, enabled ``torch.amp.GradScaler`` (Lightning's ``MixedPrecision``) gets them derived from its scale.
    """
    scaler = owner if isinstance(owner, torch.amp.GradScaler) else getattr(owner, "scaler", None)
    scaler = scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None
    for provider in (owner, scaler):
        if isinstance(provider, ScalerStatsProvider) and provider.loss_scaling:
            return StatsSource(provider.scaler_stats, scaler), scaler, ""
    if scaler is not None:
        return TorchScalerSource(scaler), scaler, ""
    label = getattr(owner, "precision", type(owner).__name__)
    return (
        None,
        None,
        f"precision {label!r} ({type(owner).__name__}) uses no loss scaler; only fp16 ('16-mixed') scales the loss.",
    )
