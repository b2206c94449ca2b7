"""Watch fp16 loss scaling: the scale, skipped steps, growths and back-offs, and optional underflow diagnostics.

fp16 training fails quietly: the loss scale collapses, optimizer steps are skipped, and gradients below fp16's
smallest subnormal (2**-24 ≈ 6e-8) flush to zero. Lightning exposes none of this (Lightning issue #9799 asks how to
even read the scale), so this callback reads it from the precision plugin without a host sync on the step path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_accel.callbacks._scale_sources import StatsSource, TorchScalerSource, select_source
from lit_accel.utilities._compat import batches_that_stepped, grad_scaler_grads_unscaled
from lit_accel.utilities._validation import check_bool, check_int, is_number

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["LossScaleMonitor"]

_FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
# fp16's smallest subnormal is 2**-24 (IEEE 754 binary16); round-to-nearest-even sends |x| <= 2**-25 to zero.
_FP16_FLUSH = 2.0**-25
_MAX_NAMES = 5


class LossScaleMonitor(Callback):
    r"""Log the fp16 loss scale, skipped optimizer steps and scale changes, and warn when scaling goes wrong.

    Works with :class:`lit_accel.AccelPrecision` (any plugin with ``scaler_stats()``, or whose scaler has
    ``stats()`` like lit_accel's ``DynamicGradScaler``: those counters know about hysteresis, a skip without a
    back-off) and with any Lightning precision plugin whose ``scaler`` is a plain ``torch.amp.GradScaler``
    (Lightning's ``MixedPrecision("16-mixed", ...)``, which ``Trainer(precision="16-mixed")`` uses on CUDA): there
    the callback keeps its own device counters, comparing the scale before and after each optimizer step (torch
    backs off on, and only on, every overflow). With bf16 or fp32 there is no loss scaling: it logs nothing and says
    so once.

    Values are read with one host sync per logging step (every ``logging_interval`` optimizer steps, by default the
    Trainer's ``log_every_n_steps``); other steps cost a few tiny device ops and no sync. Every rank computes the
    values (they agree, since gradients are all-reduced before the scaler sees them) and rank 0's loggers write them.
    Rows are logged with the step Lightning gives ``self.log`` values from the same batch (with one optimizer,
    ``trainer.global_step - 1``, the index of the optimizer step just taken), so the curves line up with the training
    loss. A batch in which several optimizers step (manual optimization) is one logging step, as for Lightning's own
    logging; ``skipped_steps`` and ``skip_rate`` count optimizer steps.

    ==============================  ====================================================================
    key (default prefix ``amp/``)    value
    ==============================  ====================================================================
    ``amp/loss_scale``              current loss scale (after this step's update)
    ``amp/skipped_steps``           optimizer steps skipped for inf/NaN gradients, cumulative
    ``amp/skip_rate``               skipped steps / optimizer steps since the previous logging step
    ``amp/scale_growths``           times the scale grew, cumulative
    ``amp/scale_backoffs``          times the scale was reduced, cumulative
    ``amp/underflow_frac``          with ``track_underflow``: fraction of the non-zero gradient elements
                                    that would flush to zero in fp16 at this step's scale
                                    (``|g·scale| <= 2**-25``); NaN if every gradient element is zero
    ``amp/overflow_headroom_log2``  with ``track_underflow``: ``log2(65504 / max|g·scale|)``, how many
                                    halvings of headroom the largest scaled gradient leaves below fp16's
                                    maximum; negative (``-inf`` for inf/NaN) means it overflowed, ``inf``
                                    that every gradient is zero
    ==============================  ====================================================================

    A well-chosen scale keeps ``underflow_frac`` near 0 and ``overflow_headroom_log2`` small but positive.

    Args:
        logging_interval: log every this many training steps (batches that stepped, as Lightning counts them for its
            logging); ``None`` uses ``Trainer(log_every_n_steps=)`` (``0`` there disables logging and the threshold
            warnings; the end-of-fit summary remains).
        log_key_prefix: prefix of every key, ``"amp/"`` by default.
        track_underflow: log ``underflow_frac`` and ``overflow_headroom_log2``. Computed at logging steps only, in
            ``on_before_optimizer_step``, where gradients are unscaled (or, for fused optimizers that unscale inside
            ``step()``, still scaled: the callback checks which and handles both). Touches every gradient.
        find_nonfinite: before every optimizer step, check each gradient for inf/NaN and, when the step is going to
            be skipped, warn with the first parameters (qualified names) whose gradients are non-finite. A debugging
            aid: it costs one host sync and a pass over all gradients per step.
        skip_rate_threshold: warn (once) when more than this fraction of the optimizer steps in a window of
            ``skip_rate_window`` steps after ``warmup_steps`` were skipped; ``None`` disables.
        skip_rate_window: length in optimizer steps of the window over which ``skip_rate_threshold`` is checked.
        warmup_steps: optimizer steps to ignore before checking the skip rate: a dynamic scaler starting at 2**16
            skips a few steps while it calibrates, which is normal.
        min_scale_threshold: warn (once) when the loss scale falls below this value; ``None`` disables. Below 1
            gradients are scaled *down*, so fp16's range is being lost.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``logging_interval``, ``skip_rate_window`` < 1, ``warmup_steps`` < 0, ``skip_rate_threshold``
            outside (0, 1], or ``min_scale_threshold`` not a positive finite number.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.loggers import CSVLogger
        from lit_accel import AccelPrecision, LossScaleMonitor

        trainer = Trainer(
            accelerator="gpu",
            devices=2,
            plugins=[AccelPrecision("16-mixed")],
            logger=CSVLogger("logs"),
            callbacks=[LossScaleMonitor(track_underflow=True)],
        )
    """

    def __init__(
        self,
        logging_interval: int | None = None,
        log_key_prefix: str = "amp/",
        track_underflow: bool = False,
        find_nonfinite: bool = False,
        skip_rate_threshold: float | None = 0.05,
        skip_rate_window: int = 100,
        warmup_steps: int = 100,
        min_scale_threshold: float | None = 1.0,
    ) -> None:
        name = type(self).__name__
        check_int(name, "logging_interval", logging_interval, allow_none=True, example=50)
        check_int(name, "skip_rate_window", skip_rate_window, example=100)
        check_int(name, "warmup_steps", warmup_steps, minimum=0, example=100)
        if not isinstance(log_key_prefix, str):
            raise TypeError(f"{name}(log_key_prefix={log_key_prefix!r}): expected a str such as 'amp/'.")
        check_bool(name, "track_underflow", track_underflow)
        check_bool(name, "find_nonfinite", find_nonfinite)
        if skip_rate_threshold is not None and not (is_number(skip_rate_threshold) and 0 < skip_rate_threshold <= 1):
            raise ValueError(
                f"{name}(skip_rate_threshold={skip_rate_threshold!r}): expected a fraction in (0, 1] such as 0.05"
                " (warn when more than 5% of steps are skipped), or None to disable the warning."
            )
        if min_scale_threshold is not None and not (
            is_number(min_scale_threshold) and 0 < min_scale_threshold < math.inf
        ):
            raise ValueError(
                f"{name}(min_scale_threshold={min_scale_threshold!r}): expected a positive finite loss scale such as"
                " 1.0, or None to disable the warning."
            )
        self.logging_interval = logging_interval
        self.log_key_prefix = log_key_prefix
        self._state_key_prefix = log_key_prefix
        self._state_key = self._generate_state_key(log_key_prefix=log_key_prefix)
        self.track_underflow = track_underflow
        self.find_nonfinite = find_nonfinite
        self.skip_rate_threshold = skip_rate_threshold
        self.skip_rate_window = skip_rate_window
        self.warmup_steps = warmup_steps
        self.min_scale_threshold = min_scale_threshold
        #: The values logged at the last logging step, on every rank (rank 0's loggers write them).
        self.last_metrics: dict[str, float] = {}

        self._source: StatsSource | TorchScalerSource | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._said_why = False
        self._names: dict[int, str] = {}
        self._min_scale: Tensor | None = None
        self._underflow: list[Tensor] | None = None  # [flushed count, non-zero count, max |g·scale|] of this step
        self._batch_start_step = 0
        # Host-side state, restored by load_state_dict.
        self._state: dict[str, Any] = {
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
    @override
    def state_key(self) -> str:
        # Lightning reads every callback's state_key on every hook call (the profiler's action name in
        # trainer/call.py), so build the string once per prefix instead of once per hook.
        if self._state_key_prefix != self.log_key_prefix:
            self._state_key_prefix = self.log_key_prefix
            self._state_key = self._generate_state_key(log_key_prefix=self.log_key_prefix)
        return self._state_key

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source, scaler, why = select_source(trainer.precision_plugin)
        if source is None:
            self._source = self._scaler = None
            if not self._said_why:
                rank_zero_info(f"LossScaleMonitor: nothing to log: {why}")
                self._said_why = True
            return
        if self._source is None or type(self._source) is not type(source) or self._scaler is not scaler:
            self._source, self._scaler = source, scaler  # else: a further fit() with the same scaler keeps counting
        if self._state["source"]:
            self._source.load_state_dict(self._state["source"])
            self._state["source"] = {}
        self._source.start()
        self._names = {id(p): n for n, p in pl_module.named_parameters()}
        if self._state["window_step"] is None:
            # One read before training (not on the step path): the baseline of a resumed AccelPrecision's counters.
            skipped = self._read().get("skipped", 0.0)
            self._state.update(window_step=trainer.global_step, window_skipped=skipped)
            if self._state["warn_step"] is None and trainer.global_step >= self.warmup_steps:
                self._state.update(warn_step=trainer.global_step, warn_skipped=skipped)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start_step = trainer.global_step
        self._underflow = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._source is None:
            return
        if self.find_nonfinite:
            self._report_nonfinite(trainer, optimizer)
        interval = self._interval(trainer)
        # Counted only once the batch ends: the step about to be taken is number batches_that_stepped + 1.
        if self.track_underflow and interval and (batches_that_stepped(trainer) + 1) % interval == 0:
            self._accumulate_underflow(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # An optimizer step happened iff global_step moved (it counts skipped steps too): correct under gradient
        # accumulation, where most batches do not step. Rows follow Lightning's logging cadence, where a batch in
        # which several optimizers stepped is one step; skip rates count optimizer steps, as skipped_steps does.
        start, step = self._batch_start_step, trainer.global_step
        if self._source is None or step == start:
            return
        self._state["steps_seen"] += step - start  # optimizer steps: the unit of skipped_steps and skip_rate
        self._source.after_step()
        scale = self._source.scale()
        if scale is not None:
            self._update_min(scale)
        interval = self._interval(trainer)
        batch_steps = batches_that_stepped(trainer) + 1  # Lightning increments it after this hook
        if interval and batch_steps % interval == 0:
            self._log(trainer, step, label=batch_steps - 1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._source is None:
            return
        values = self._read()
        if not values:
            rank_zero_info("LossScaleMonitor: no optimizer step used the loss scaler.")
            return
        steps = self._state["steps_seen"]
        rank_zero_info(
            f"LossScaleMonitor: {values['skipped']:.0f} of {steps} optimizer steps skipped"
            f" ({values['skipped'] / max(steps, 1):.1%}); loss scale final {values['scale']:g},"
            f" minimum {values['min_scale']:g}."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The callback's counters and windows, as Python numbers (reading them syncs once, at checkpoint time)."""
        state = dict(self._state)
        if self._min_scale is not None:
            state["min_scale"] = self._min_scale.item()
        if self._source is not None:
            state["source"] = self._source.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state.update(state_dict)
        self._min_scale = None  # rebuilt on the scale's device from state["min_scale"] at the next step
        if self._source is not None and self._state["source"]:
            self._source.load_state_dict(self._state["source"])
            self._state["source"] = {}

    def _update_min(self, scale: Tensor) -> None:
        """Track the minimum scale on the device (no sync); seeded from a checkpoint's minimum when resuming."""
        scale = scale.detach().float()
        if self._min_scale is None:
            loaded = self._state["min_scale"]
            self._min_scale = scale.clone()
            if loaded is not None:
                self._min_scale.clamp_(max=loaded)
        else:
            torch.minimum(self._min_scale, scale, out=self._min_scale)

    def _interval(self, trainer: pl.Trainer) -> int:
        return self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps

    def _read(self) -> dict[str, float]:
        """Read every device value with one ``stack(...).tolist()``: the callback's only host sync (logging steps)."""
        assert self._source is not None
        counters = self._source.counters()
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
        names = ["scale", "skipped", "growths", "backoffs", "min_scale", "underflow_frac", "headroom"]
        return dict(zip(names, values))

    def _log(self, trainer: pl.Trainer, step: int, label: int) -> None:
        """Log the values after optimizer step ``step`` (cumulative count) at Lightning's logging step ``label``."""
        values = self._read()
        self._underflow = None
        if not values:
            return
        window_steps = step - self._state["window_step"]
        skip_rate = (values["skipped"] - self._state["window_skipped"]) / window_steps if window_steps > 0 else 0.0
        p = self.log_key_prefix
        metrics: dict[str, float] = {
            f"{p}loss_scale": values["scale"],
            f"{p}skipped_steps": int(values["skipped"]),
            f"{p}skip_rate": skip_rate,
            f"{p}scale_growths": int(values["growths"]),
            f"{p}scale_backoffs": int(values["backoffs"]),
        }
        if "underflow_frac" in values:
            metrics[f"{p}underflow_frac"] = values["underflow_frac"]
            metrics[f"{p}overflow_headroom_log2"] = values["headroom"]
        self.last_metrics = metrics
        for logger in trainer.loggers:  # Lightning's loggers write on rank 0 only
            logger.log_metrics(metrics, step=label)
        self._state.update(window_step=step, window_skipped=values["skipped"])
        self._check_thresholds(step, values)

    def _check_thresholds(self, step: int, values: dict[str, float]) -> None:
        state = self._state
        threshold = self.min_scale_threshold
        if threshold is not None and not state["warned_scale"] and values["min_scale"] < threshold:
            state["warned_scale"] = True
            rank_zero_warn(
                f"LossScaleMonitor: by optimizer step {step - 1} the loss scale fell to {values['min_scale']:g}"
                f" (below {threshold:g}): gradients are scaled down, so small ones flush to zero in fp16 (smallest"
                " subnormal 2**-24 ≈ 6e-8). This usually means persistent inf/NaN, not large gradients: check the"
                " data and the loss for inf/NaN (LossScaleMonitor(find_nonfinite=True) names the parameters), lower"
                " the learning rate, clip gradients (Trainer(gradient_clip_val=1.0)), or use precision='bf16-mixed'"
                " where the hardware supports it."
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
            rank_zero_warn(
                f"LossScaleMonitor: {rate:.1%} of optimizer steps {step - steps}-{step - 1} were skipped for inf/NaN"
                f" gradients (threshold {self.skip_rate_threshold:.1%}); the model does not learn on those steps."
                " Try a lower learning rate or a longer warm-up, gradient clipping (Trainer(gradient_clip_val=1.0)),"
                " checking the data for inf/NaN, LossScaleMonitor(find_nonfinite=True) to name the parameters, or"
                " precision='bf16-mixed' where the hardware supports it."
            )

    def _grads(self, optimizer: Optimizer) -> list[tuple[int, Tensor]]:
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad.coalesce().values() if param.grad.is_sparse else param.grad
                    grads.append((id(param), grad.detach()))
        return grads

    def _accumulate_underflow(self, optimizer: Optimizer) -> None:
        scale = self._source.scale() if self._source is not None else None
        if scale is None:
            return
        scale = scale.detach().float()
        # MixedPrecision and AccelPrecision unscale before this hook, except for fused optimizers, which take the
        # scale into step() (torch.amp.GradScaler.step): then the gradients here are still scaled.
        unscaled = self._scaler is None or grad_scaler_grads_unscaled(self._scaler, optimizer)
        flushed = torch.zeros((), dtype=torch.int64, device=scale.device)
        nonzero = torch.zeros((), dtype=torch.int64, device=scale.device)
        largest = torch.zeros((), dtype=torch.float32, device=scale.device)
        for _, grad in self._grads(optimizer):
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

    def _report_nonfinite(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        grads = self._grads(optimizer)
        if not grads:
            return
        # The documented per-step sync of find_nonfinite=True.
        bad = torch.stack([~torch.isfinite(g).all() for _, g in grads]).nonzero().flatten().tolist()
        if not bad:
            return
        shown = [
            f"{self._names.get(grads[i][0], '<unnamed>')} ({'nan' if torch.isnan(grads[i][1]).any() else 'inf'})"
            for i in bad[:_MAX_NAMES]
        ]
        more = f" and {len(bad) - _MAX_NAMES} more" if len(bad) > _MAX_NAMES else ""
        rank_zero_warn(
            f"LossScaleMonitor: optimizer step {trainer.global_step} is skipped: non-finite gradients in"
            f" {len(bad)} of {len(grads)} parameters: {', '.join(shown)}{more}."
        )
