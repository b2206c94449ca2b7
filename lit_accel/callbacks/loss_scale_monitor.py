"""``LossScaleMonitor``: the Lightning adapter of :class:`~lit_accel.meters.LossScaleMeter`."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_accel.meters.loss_scale import LossScaleMeter
from lit_accel.meters.plots import loss_scale_figure, save_report
from lit_accel.utilities._compat import batches_that_stepped, grad_scaler_grads_unscaled
from lit_accel.utilities._idle_hooks import idle, idle_unused, wake
from lit_accel.utilities._validation import check_bool, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["LossScaleMonitor"]

_MAX_NAMES = 5


class LossScaleMonitor(Callback):
    """Log the fp16 loss scale, skipped optimizer steps and scale changes, and warn when scaling goes wrong.

    Works with any precision plugin that follows :class:`lit_accel.protocols.ScalerStatsProvider` (``AccelPrecision``;
    its counters know hysteresis) or whose ``scaler`` is a ``torch.amp.GradScaler`` (Lightning's ``MixedPrecision``).
    With bf16/fp32 there is no loss scaling: it logs nothing and says so once. Values are read with one host sync per
    logging step (every ``logging_interval`` steps, default the Trainer's ``log_every_n_steps``), at the step of the
    batch's own ``self.log`` values; a batch in which several optimizers step is one logging step.

    Keys (prefix ``amp/``): ``loss_scale``, ``skipped_steps`` (cumulative), ``skip_rate`` (since the previous log),
    ``scale_growths``, ``scale_backoffs``; with ``track_underflow``: ``underflow_frac`` (non-zero gradient elements
    that would flush to zero in fp16 at this scale) and ``overflow_headroom_log2`` (``log2(65504 / max|g·scale|)``).

    Args:
        logging_interval: log every this many training steps; ``None``: ``Trainer(log_every_n_steps=)``.
        log_key_prefix: prefix of every key.
        track_underflow: log the underflow figures (touches every gradient, at logging steps only).
        find_nonfinite: before every step, name the first parameters with inf/NaN gradients when the step will be
            skipped (a debugging aid: one host sync and a pass over the gradients per step).
        skip_rate_threshold, skip_rate_window, warmup_steps, min_scale_threshold: warnings, see ``LossScaleMeter``.
        report_path: where rank 0 writes the summary and every logged value (JSON) and their picture (the same path
            with ``.png``) at the end of fit; ``None``: no files.

    Raises:
        TypeError: an argument of the wrong type. ValueError: an out-of-range value.

    Example::

        trainer = Trainer(plugins=[AccelPrecision("16-mixed")], callbacks=[LossScaleMonitor(track_underflow=True)])
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
        report_path: str | os.PathLike[str] | None = None,
    ) -> None:
        name = type(self).__name__
        if report_path is not None and not isinstance(report_path, (str, os.PathLike)):
            raise TypeError(f"{name}(report_path={report_path!r}): expected a path or None. Fix: 'runs/amp.json'.")
        check_int(name, "logging_interval", logging_interval, allow_none=True, example=50)
        if not isinstance(log_key_prefix, str):
            raise TypeError(f"{name}(log_key_prefix={log_key_prefix!r}): expected a str. Fix: pass e.g. 'amp/'.")
        check_bool(name, "track_underflow", track_underflow)
        check_bool(name, "find_nonfinite", find_nonfinite)
        self.meter = LossScaleMeter(
            skip_rate_threshold=skip_rate_threshold,
            skip_rate_window=skip_rate_window,
            warmup_steps=warmup_steps,
            min_scale_threshold=min_scale_threshold,
            warn=rank_zero_warn,
        )
        self.logging_interval = logging_interval
        self.log_key_prefix = log_key_prefix
        self._state_key_prefix = log_key_prefix
        self._state_key = self._generate_state_key(log_key_prefix=log_key_prefix)
        self.track_underflow = track_underflow
        self.find_nonfinite = find_nonfinite
        #: The values logged at the last logging step, on every rank (rank 0's loggers write them).
        self.last_metrics: dict[str, float] = {}
        #: ``{"step": ..., key: value}`` (keys without the prefix) of every logging step of the last fit.
        self.history: list[dict[str, float]] = []
        self.report_path = None if report_path is None else Path(report_path)
        self._said_why = False
        self._names: dict[int, str] = {}
        self._last_step = 0  # global step at the end of the previous batch (a batch that moves it stepped)
        idle_unused(self)

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads every callback's state_key on every hook call: build the string once per prefix.
        if self._state_key_prefix != self.log_key_prefix:
            self._state_key_prefix = self.log_key_prefix
            self._state_key = self._generate_state_key(log_key_prefix=self.log_key_prefix)
        return self._state_key

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.history = []
        self._last_step = trainer.global_step
        hooks = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")
        wake(self, *hooks)
        if not self.track_underflow:  # the hooks before the step have work only for these figures and names
            idle(self, LossScaleMonitor, *hooks[: 1 if self.find_nonfinite else 2])
        if not self.meter.attach(trainer.precision_plugin, trainer.global_step):
            idle(self, LossScaleMonitor, *hooks)
            if not self._said_why:
                rank_zero_info(f"LossScaleMonitor: nothing to log: {self.meter.why}")
                self._said_why = True
            return
        self._names = {id(p): n for n, p in pl_module.named_parameters()}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.meter.begin_batch()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self.meter.active:
            return
        if self.find_nonfinite:
            self._report_nonfinite(trainer, optimizer)
        interval = self._interval(trainer)
        # Counted only once the batch ends: the step about to be taken is number batches_that_stepped + 1.
        if self.track_underflow and interval and (batches_that_stepped(trainer) + 1) % interval == 0:
            # Plugins unscale before this hook, except for fused optimizers, which take the scale into step().
            scaler = self.meter.scaler
            unscaled = scaler is None or grad_scaler_grads_unscaled(scaler, optimizer)
            self.meter.add_underflow((g for _, g in _grads(optimizer)), unscaled)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # An optimizer step happened iff global_step moved (skipped steps count too): right under accumulation.
        start, step = self._last_step, trainer.global_step
        if not self.meter.active or step == start:
            return
        self._last_step = step
        self.meter.step(step - start)
        interval = self._interval(trainer)
        batch_steps = batches_that_stepped(trainer) + 1  # Lightning increments it after this hook
        if interval and batch_steps % interval == 0:
            metrics = self.meter.compute(step)
            if metrics:
                self.history.append({"step": batch_steps - 1, **metrics})
                self.last_metrics = {self.log_key_prefix + k: v for k, v in metrics.items()}
                for logger in trainer.loggers:  # Lightning's loggers write on rank 0 only
                    logger.log_metrics(self.last_metrics, step=batch_steps - 1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.meter.active:
            return
        summary = self.meter.summary()
        if not summary:
            rank_zero_info("LossScaleMonitor: no optimizer step used the loss scaler.")
            return
        steps = summary["steps"]
        rank_zero_info(
            f"LossScaleMonitor: {summary['skipped_steps']:.0f} of {steps:.0f} optimizer steps skipped"
            f" ({summary['skipped_steps'] / max(steps, 1):.1%}); loss scale final {summary['loss_scale']:g},"
            f" minimum {summary['min_scale']:g}."
        )
        if trainer.is_global_zero and self.report_path is not None:
            title = f"LossScaleMonitor: {trainer.precision}, {summary['skipped_steps']:.0f} of {steps:.0f} skipped"
            report = {"summary": summary, "history": self.history}
            figure = partial(loss_scale_figure, self.history, title)
            save_report(self.report_path, report, figure, "LossScaleMonitor", rank_zero_info)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.meter.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.meter.load_state_dict(state_dict)

    def _interval(self, trainer: pl.Trainer) -> int:
        return self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps

    def _report_nonfinite(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        grads = _grads(optimizer)
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


def _grads(optimizer: Optimizer) -> list[tuple[int, Tensor]]:
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grad = param.grad.coalesce().values() if param.grad.is_sparse else param.grad
                grads.append((id(param), grad.detach()))
    return grads
