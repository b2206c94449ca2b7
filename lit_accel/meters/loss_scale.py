"""``LossScaleMeter``: what fp16 loss scaling is doing (scale, skips, growths, back-offs, underflow), sync-free.

No Lightning here: drive it from any loop with a scaler (``AccelPrecision``, a ``DynamicGradScaler`` or a plain
``torch.amp.GradScaler``); the ``LossScaleMonitor`` callback is a thin adapter over it. Per optimizer step it runs a
few tiny device ops for a plain ``GradScaler``, one for a ``DynamicGradScaler`` step that may have changed the scale
and none for a clean one; :meth:`LossScaleMeter.compute` reads everything with one ``stack(...).tolist()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lit_accel.meters._scale_sources import ScaleSource, select_source
from lit_accel.utilities._validation import check_int, is_number
from lit_accel.utilities._warnings import rank_zero_warn

__all__ = ["LossScaleMeter"]

_FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
# fp16's smallest subnormal is 2**-24 (IEEE 754 binary16); round-to-nearest-even sends |x| <= 2**-25 to zero.
_FP16_FLUSH = 2.0**-25
_NAMES = ("scale", "skipped", "growths", "backoffs", "min_scale", "underflow_frac", "headroom")


class LossScaleMeter:
    """Track a loss scaler across optimizer steps and read it, with thresholds, at logging steps.

    Call :meth:`attach` with the precision plugin (or scaler) once, :meth:`step` after every optimizer step, and
    :meth:`compute` at logging steps. Warnings go to ``warn`` once each: more than ``skip_rate_threshold`` of the
    steps in a window of ``skip_rate_window`` skipped (after ``warmup_steps``), or a scale below
    ``min_scale_threshold``.

    Args:
        skip_rate_threshold: fraction in (0, 1], or ``None`` for no skip-rate warning.
        skip_rate_window: optimizer steps over which the skip rate is checked.
        warmup_steps: optimizer steps ignored before checking (a scaler starting at 2**16 calibrates first).
        min_scale_threshold: positive scale, or ``None`` for no low-scale warning.
        warn: where warnings go (by default ``warnings.warn`` on global rank 0 only).

    Raises:
        ValueError: a threshold or window out of range. TypeError: a wrong type.

    Example::

        meter = LossScaleMeter()
        meter.attach(scaler)  # a torch.amp.GradScaler, or a plugin with scaler_stats()
        for step in range(steps):
            ...; scaler.step(opt); scaler.update(); meter.step(step + 1)
            if (step + 1) % 50 == 0:
                print(meter.compute(step + 1))
    """

    def __init__(
        self,
        *,
        skip_rate_threshold: float | None = 0.05,
        skip_rate_window: int = 100,
        warmup_steps: int = 100,
        min_scale_threshold: float | None = 1.0,
        warn: Callable[[str], Any] = rank_zero_warn,
    ) -> None:
        name = "LossScaleMonitor"
        check_int(name, "skip_rate_window", skip_rate_window, example=100)
        check_int(name, "warmup_steps", warmup_steps, minimum=0, example=100)
        if skip_rate_threshold is not None and not (is_number(skip_rate_threshold) and 0 < skip_rate_threshold <= 1):
            raise ValueError(
                f"{name}(skip_rate_threshold={skip_rate_threshold!r}): expected a fraction in (0, 1] such as 0.05 (warn"
                " above 5% skipped steps), or None to disable the warning."
            )
        if min_scale_threshold is not None and not (
            is_number(min_scale_threshold) and 0 < min_scale_threshold < math.inf
        ):
            raise ValueError(
                f"{name}(min_scale_threshold={min_scale_threshold!r}): expected a positive finite loss scale such as"
                " 1.0, or None to disable the warning."
            )
        self.skip_rate_threshold = skip_rate_threshold
        self.skip_rate_window = skip_rate_window
        self.warmup_steps = warmup_steps
        self.min_scale_threshold = min_scale_threshold
        self._warn = warn
        self.source: ScaleSource | None = None
        self.scaler: torch.amp.GradScaler | None = None
        #: Why there is nothing to measure, after :meth:`attach` found no loss scaling.
        self.why = ""
        self._min_scale: Tensor | None = None
        self._underflow: list[Tensor] | None = None  # [flushed count, non-zero count, max |g·scale|] of this step
        # Host-side state, saved in checkpoints.
        self.state: dict[str, Any] = {
            "steps_seen": 0,
            "min_scale": None,
            "window_step": None,  # start of the current logging window and the skipped count there
            "window_skipped": 0.0,
            "warn_step": None,  # start of the current skip-rate warning window
            "warn_skipped": 0.0,
            "warned_skip_rate": False,
            "warned_scale": False,
            "source": {},
        }

    @property
    def active(self) -> bool:
        """Whether a loss scaler is attached."""
        return self.source is not None

    def attach(self, owner: Any, step: int = 0) -> bool:
        """Read ``owner``'s scaler from now on (a plugin or a ``GradScaler``); ``step`` is the optimizer step count.

        A further fit with the same scaler keeps counting. One host read here, not on the step path. Returns
        whether there is loss scaling to watch (else :attr:`why` says why).
        """
        source, scaler, self.why = select_source(owner)
        if source is None:
            self.source = self.scaler = None
            return False
        if self.source is None or type(self.source) is not type(source) or self.scaler is not scaler:
            self.source, self.scaler = source, scaler
        if self.state["source"]:
            self.source.load_state_dict(self.state["source"])
            self.state["source"] = {}
        self.source.start()
        if self.state["window_step"] is None:
            skipped = self._read().get("skipped", 0.0)  # the baseline of a resumed scaler's counters
            self.state.update(window_step=step, window_skipped=skipped)
            if self.state["warn_step"] is None and step >= self.warmup_steps:
                self.state.update(warn_step=step, warn_skipped=skipped)
        return True

    def step(self, optimizer_steps: int = 1) -> None:
        """After ``optimizer_steps`` optimizer steps (a batch with several optimizers counts each): device ops only."""
        if self.source is None:
            return
        self.state["steps_seen"] += optimizer_steps
        self.source.after_step()
        if not self.source.scale_changed() and self._min_scale is not None:
            return  # the minimum cannot have moved: no op on a clean step
        scale = self.source.scale()
        if scale is not None:
            self._update_min(scale)

    def add_underflow(self, grads: Iterable[Tensor], unscaled: bool) -> None:
        """Accumulate this step's underflow and headroom figures over ``grads`` (device ops; a logging-step tool).

        ``unscaled``: the gradients are already divided by the scale (not so for fused optimizers before step()).
        """
        scale = self.source.scale() if self.source is not None else None
        if scale is None:
            return
        scale = scale.detach().float()
        flushed = torch.zeros((), dtype=torch.int64, device=scale.device)
        nonzero = torch.zeros((), dtype=torch.int64, device=scale.device)
        largest = torch.zeros((), dtype=torch.float32, device=scale.device)
        for grad in grads:
            if grad.numel() == 0:
                continue
            scaled = grad.float().abs() * scale if unscaled else grad.float().abs()
            is_nonzero = grad != 0
            nonzero += is_nonzero.sum()
            flushed += (is_nonzero & (scaled <= _FP16_FLUSH)).sum()
            top = scaled.max()
            # NaN gradients (an overflow's inf·0) count as infinitely large: headroom -inf, not NaN.
            largest = torch.maximum(largest, torch.where(top.isnan(), math.inf, top))
        if self._underflow is not None:  # several optimizers stepped in this batch
            flushed, nonzero = flushed + self._underflow[0], nonzero + self._underflow[1]
            largest = torch.maximum(largest, self._underflow[2])
        self._underflow = [flushed, nonzero, largest]

    def compute(self, step: int) -> dict[str, float]:
        """The values after optimizer step ``step`` (cumulative count): one host sync. Checks the thresholds."""
        values = self._read()
        self._underflow = None
        if not values:
            return {}
        window_steps = step - self.state["window_step"]
        skipped = values["skipped"]
        metrics: dict[str, float] = {
            "loss_scale": values["scale"],
            "skipped_steps": int(skipped),
            "skip_rate": (skipped - self.state["window_skipped"]) / window_steps if window_steps > 0 else 0.0,
            "scale_growths": int(values["growths"]),
            "scale_backoffs": int(values["backoffs"]),
        }
        if "underflow_frac" in values:
            metrics["underflow_frac"] = values["underflow_frac"]
            metrics["overflow_headroom_log2"] = values["headroom"]
        self.state.update(window_step=step, window_skipped=skipped)
        self._check_thresholds(step, values)
        return metrics

    def summary(self) -> dict[str, float]:
        """Final scale, skipped steps, optimizer steps seen and minimum scale (one host sync)."""
        values = self._read()
        if not values:
            return {}
        return {"loss_scale": values["scale"], "skipped_steps": values["skipped"], "min_scale": values["min_scale"],
                "steps": float(self.state["steps_seen"])}  # fmt: skip

    def begin_batch(self) -> None:
        """Forget underflow figures of a batch that did not log."""
        self._underflow = None

    # ------------------------------------------------------------------ internals

    def _update_min(self, scale: Tensor) -> None:
        scale = (scale.detach() if scale.requires_grad else scale).float()  # one op per step: the minimum
        if self._min_scale is None:
            loaded = self.state["min_scale"]
            self._min_scale = scale.clone()
            if loaded is not None:
                self._min_scale.clamp_(max=loaded)
        else:
            torch.minimum(self._min_scale, scale, out=self._min_scale)

    def _read(self) -> dict[str, float]:
        """Every device value with one ``stack(...).tolist()``: the meter's only host sync."""
        if self.source is None:
            return {}
        counters = self.source.counters()
        if counters is None:
            return {}
        scale = counters.scale.detach()
        self._update_min(scale)
        assert self._min_scale is not None
        # float64 keeps the int64 counters exact; MPS has no float64.
        dtype = torch.float32 if scale.device.type == "mps" else torch.float64
        parts = [*counters, self._min_scale]
        if self._underflow is not None:
            flushed, nonzero, largest = self._underflow
            parts += [flushed.double() / nonzero.double(), torch.log2(_FP16_MAX / largest.double())]
        values = torch.stack([p.to(device=scale.device, dtype=dtype) for p in parts]).tolist()
        return dict(zip(_NAMES, values))

    def _check_thresholds(self, step: int, values: dict[str, float]) -> None:
        state, threshold = self.state, self.min_scale_threshold
        if threshold is not None and not state["warned_scale"] and values["min_scale"] < threshold:
            state["warned_scale"] = True
            self._warn(
                f"LossScaleMonitor: by optimizer step {step - 1} the loss scale fell to {values['min_scale']:g}, below"
                f" {threshold:g}: small gradients flush to zero in fp16, usually from persistent inf/NaN. Fix: check"
                " the data and loss (find_nonfinite=True names the parameters), lower the learning rate, clip"
                " gradients, or use 'bf16-mixed'."
            )
        if self.skip_rate_threshold is None or state["warned_skip_rate"] or step < self.warmup_steps:
            return
        if state["warn_step"] is None:
            state.update(warn_step=step, warn_skipped=values["skipped"])
            return
        steps = step - state["warn_step"]
        if steps < self.skip_rate_window:
            return
        rate = (values["skipped"] - state["warn_skipped"]) / steps
        state.update(warn_step=step, warn_skipped=values["skipped"])
        if rate > self.skip_rate_threshold:
            state["warned_skip_rate"] = True
            self._warn(
                f"LossScaleMonitor: {rate:.1%} of optimizer steps {step - steps}-{step - 1} were skipped for inf/NaN"
                f" gradients (threshold {self.skip_rate_threshold:.1%}). Fix: lower the learning rate or lengthen the"
                " warm-up, clip gradients, check the data, or use 'bf16-mixed'."
            )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Counters and windows as Python numbers (reading them syncs once, at checkpoint time)."""
        state = dict(self.state)
        if self._min_scale is not None:
            state["min_scale"] = self._min_scale.item()
        if self.source is not None:
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before or after :meth:`attach`)."""
        self.state.update(state_dict)
        self._min_scale = None  # rebuilt on the scale's device from state["min_scale"] at the next step
        if self.source is not None and self.state["source"]:
            self.source.load_state_dict(self.state["source"])
            self.state["source"] = {}
