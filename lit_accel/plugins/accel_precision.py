"""``AccelPrecision``: Lightning's ``MixedPrecision`` with a bounded loss scaler, skip-aware schedulers and FP8."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lit_accel.plugins import _precision_support as support
from lit_accel.plugins._min_scale import MinScaleStop
from lit_accel.plugins.float8 import Float8Conversion, Float8Report, ModuleFilter
from lit_accel.plugins.grad_scaler import DynamicGradScaler
from lit_accel.protocols import SkippedStepRecord
from lit_accel.utilities import _compat, _workarounds
from lit_accel.utilities._validation import check_choice

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import LRSchedulerConfig
    from torchao.float8 import Float8LinearConfig

__all__ = ["AccelPrecision"]


class AccelPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` with a bounded fp16 loss scaler, skip-aware LR schedulers and FP8 Linear layers.

    A drop-in: same ``precision``, ``device``, ``scaler``, ``autocast_context_manager()`` and checkpoint keys; fp32
    master weights. With ``"16-mixed"`` a skipped step (inf/NaN gradients) does not advance step-interval LR schedulers,
    and a ``DynamicGradScaler`` stuck at ``min_scale`` stops the run with an explanation; real fp16 on CPU too. bf16 has
    no scaler: add the ``NonFiniteGuard`` callback. Full precision needs no plugin. Details: ``docs/precision.md``.

    Args:
        precision: ``"16-mixed"`` (or Lightning's ``16``, ``"16"``), ``"bf16-mixed"`` (``"bf16"``) or ``"fp8-mixed"``
            (torchao FP8 Linear layers, bf16 autocast for the rest; emulated on CPU).
        device: ``"cpu"`` or ``"cuda"``; ``None`` follows the Trainer's device (set in ``connect()``).
        scaler: the fp16 loss scaler, used as given: a :class:`~lit_accel.DynamicGradScaler` (the default) or a
            ``torch.amp.GradScaler`` (torch's rule, no min-scale stop).
        float8, float8_filter: ``"fp8-mixed"`` only: torchao's ``Float8LinearConfig`` or a ``Float8Conversion``, and
            which Linear layers to convert (a callable, or fnmatch names to leave out, e.g. ``["head"]``).
        on_min_scale: an overflow at the ``DynamicGradScaler``'s ``min_scale``: ``"raise"`` (default) or ``"warn"``.
        min_scale_check_interval: with fused optimizers, read the min-scale counter every this many steps.

    Raises:
        ValueError: an unknown option (naming the closest precision), ``"32-true"``, a scaler with bf16/FP8.
        TypeError: ``scaler`` is not a ``GradScaler``; in ``connect()``: ``LBFGS`` with ``"16-mixed"``.
        RuntimeError: while fitting, the scale is at ``min_scale`` and still overflows (``on_min_scale="raise"``).

    Example::

        plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(hysteresis=2, growth_interval=1000))
        trainer = Trainer(accelerator="gpu", devices=8, strategy="accel_ddp", plugins=[plugin])
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "fp8-mixed", 16, "16", "bf16"],
        device: Literal["cpu", "cuda"] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        float8: Float8LinearConfig | Float8Conversion | None = None,
        float8_filter: ModuleFilter | None = None,
        on_min_scale: Literal["raise", "warn"] = "raise",
        min_scale_check_interval: int = 100,
    ) -> None:
        name = type(self).__name__
        precision = support.resolve_precision(name, precision)
        check_choice(name, "device", device, (None, "cpu", "cuda"), "None, to follow the Trainer's device")
        support.check_scaler(name, precision, scaler)
        if precision == "16-mixed" and scaler is None:
            scaler = DynamicGradScaler()
        guess = device or ("cuda" if torch.cuda.is_available() else "cpu")  # the Trainer's device wins in connect()
        super().__init__("16-mixed" if precision == "16-mixed" else "bf16-mixed", guess, scaler)
        self.precision = precision  # type: ignore[assignment]
        self._device_arg = device
        self.min_scale_stop = MinScaleStop(name, on_min_scale, min_scale_check_interval)
        self._float8 = support.float8_conversion(name, precision, float8, float8_filter)
        self._fp8_model: nn.Module | None = None  # the model converted at setup, reverted at teardown
        #: The record of each optimizer's last step (by id): skipped or not, a 0-d device flag where only the device
        #: knows (fused optimizers, torch's GradScaler). Skip-aware schedulers read it through ``step_was_skipped``.
        self._skipped: dict[int, bool | Tensor] = {}
        self._mentioned_guard = False
        if device == "cpu" and isinstance(scaler, DynamicGradScaler):
            # Only on CPU: CUDA tensors created before a fork-based launcher starts its workers would break CUDA
            # there, and the rank's GPU is only known in connect().
            scaler.to("cpu")

    @property
    def float8_report(self) -> Float8Report | None:
        """``"fp8-mixed"``: the Linear layers converted at setup and why the others were not (``None`` before)."""
        return None if self._float8 is None else self._float8.report

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (before setup: the one it will start from); ``1.0`` without a scaler. Syncs."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """fp16 optimizer steps a ``DynamicGradScaler`` skipped for inf/NaN gradients (else 0). Syncs."""
        return int(self.scaler.state_dict()["skipped_steps"]) if isinstance(self.scaler, DynamicGradScaler) else 0

    def step_was_skipped(self, optimizer: Optimizer | None = None) -> bool:
        """Whether the last step of ``optimizer`` (of any optimizer, for ``None``) was skipped (``SkippedStepRecord``).

        Where only the device knows (fused optimizers, a torch ``GradScaler``), the answer costs one host sync.
        """
        key = None if optimizer is None else id(support.unwrap(optimizer))
        flags = self._skipped.values() if key is None else [self._skipped.get(key, False)]
        return any(bool(flag) for flag in flags)

    @override
    def autocast_context_manager(self) -> torch.autocast:
        """``torch.autocast`` in fp16 (``"16-mixed"``) or bf16 (``"bf16-mixed"``, ``"fp8-mixed"``)."""
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        # cache_enabled=False as in Lightning's MixedPrecision: weights are re-cast on every use inside the context.
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[nn.Module, list[Optimizer], list[LRSchedulerConfig]]:
        """Place the scaler on the Trainer's device, refuse optimizers fp16 cannot drive, make schedulers skip-aware."""
        name = type(self).__name__
        trainer = support.trainer_of(model)
        device = trainer.strategy.root_device if trainer is not None else torch.device(self.device)
        if device.type not in ("cpu", "cuda") or self._device_arg not in (None, device.type):
            supported = device.type in ("cpu", "cuda")
            fix = "pass device=None (the default) to follow the Trainer" if supported else "train on CPU or CUDA"
            raise RuntimeError(f"{name}(device={self._device_arg!r}) but the Trainer runs on {device}. Fix: {fix}.")
        self.device = device.type
        self._skipped = {}
        if self.scaler is None:
            self._mention_guard(trainer)
            return model, optimizers, lr_schedulers
        if isinstance(self.scaler, DynamicGradScaler):
            self.scaler.to(device)
        support.check_optimizers(name, optimizers, trainer.gradient_clip_val if trainer is not None else None)
        return model, optimizers, _workarounds.skip_aware_schedulers(lr_schedulers, self)

    def _mention_guard(self, trainer: pl.Trainer | None) -> None:
        # A callback that keeps the skip record (NonFiniteGuard, or a user's own) guards the steps.
        guarded = trainer is not None and any(isinstance(cb, SkippedStepRecord) for cb in trainer.callbacks)
        if not (guarded or self._mentioned_guard):
            self._mentioned_guard = True
            rank_zero_info(
                f"{type(self).__name__}({self.precision!r}): inf/NaN gradients are not checked (no loss scaler), as in"
                " Lightning; add callbacks=[NonFiniteGuard()] to stop (or skip) such a step before it reaches the"
                " weights."
            )

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """``"fp8-mixed"``: convert the eligible Linear layers in place (before the strategy wraps or shards them)."""
        if self._float8 is None:
            return module
        if self._fp8_model is not module:  # a strategy that converts twice (setup after a restart): done already
            trainer = support.trainer_of(module)
            device = trainer.strategy.root_device if trainer is not None else torch.device(self.device)
            self._fp8_model = self._float8.apply(module, device)
        return self._fp8_model

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        """As ``forward_context``; ``"fp8-mixed"`` runs under ``no_grad``, not inference mode (docs/precision.md)."""
        if self._float8 is not None and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad(), self.forward_context():
                yield
        else:
            with self.forward_context():
                yield

    test_step_context = val_step_context
    predict_step_context = val_step_context

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:  # bf16, FP8: Lightning's own step
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        backward = closure_result is not None or not model.automatic_optimization
        if not (backward and support.has_grads(optimizer)):
            return self._step_unscaled(optimizer, model, closure_result, **kwargs)
        if not (
            _compat.optimizer_handles_amp_scaling(optimizer)
            or _compat.grad_scaler_grads_unscaled(self.scaler, optimizer)
        ):
            self.scaler.unscale_(optimizer)  # before the hooks and clipping see the gradients (fused: only to clip)
        self._after_closure(model, optimizer)
        output = self.scaler.step(optimizer, **kwargs)  # skips optimizer.step() (or the fused kernel) on inf/NaN
        self._skipped[id(optimizer)] = skipped = _compat.grad_scaler_step_skipped(self.scaler, optimizer)
        self.scaler.update()
        self.min_scale_stop.after_update(self.scaler, skipped, model.trainer)
        return output

    def _step_unscaled(self, optimizer: Optimizer, model: pl.LightningModule, result: Any, **kwargs: Any) -> Any:
        """No backward (``training_step`` returned None), or, in manual optimization, none that reached this optimizer.

        Nothing scaled to unscale or check: not a skipped step (schedulers move, as in Lightning).
        """
        self._after_closure(model, optimizer)
        self._skipped[id(optimizer)] = False
        if model.automatic_optimization:
            _compat.reset_grad_scaler_iteration(self.scaler)  # a clip may have unscaled zeroed gradients: no step
            return result
        return optimizer.step(**kwargs)  # torch's GradScaler would assert: no inf checks were recorded

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip unscaled gradients: still-scaled ones (fused optimizers, manual optimization) are unscaled first."""
        optimizer = support.unwrap(optimizer)
        scaler = self.scaler
        if scaler is not None and clip_val > 0 and not _compat.grad_scaler_grads_unscaled(scaler, optimizer):
            support.refuse_self_unscaling(type(self).__name__, optimizer, clip_val)
            if support.has_grads(optimizer):
                scaler.unscale_(optimizer)
        # Not MixedPrecision's, which refuses fused optimizers.
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def teardown(self) -> None:
        """``"fp8-mixed"``: put the original Linear layers back (unless sharding holds the converted ones)."""
        model, self._fp8_model = self._fp8_model, None
        if model is not None:
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for p in model.parameters()):
                # FSDP2 holds the converted layers (its parameters point at them): swapping them would detach it.
                rank_zero_info(f"{type(self).__name__}('fp8-mixed'): the sharded model keeps its Float8Linear layers.")
            else:
                self._float8.revert(model)
        super().teardown()

    @override
    def state_dict(self) -> dict[str, Any]:
        """fp16: the scaler's state (torch's keys, as ``MixedPrecision``), its counters, the min-scale record. Syncs."""
        if self.scaler is None:
            return {}
        return {**self.scaler.state_dict(), "outcomes": self.min_scale_stop.state_dict(), "precision": self.precision}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``, a ``MixedPrecision``/``GradScaler`` state, or a lit_accel 0.1 checkpoint's."""
        saved_precision, scaler_state = support.scaler_state_of(state_dict)
        if saved_precision != self.precision:
            rank_zero_warn(
                f"{type(self).__name__}({self.precision!r}): the checkpoint was saved with"
                f" precision={saved_precision!r}; its loss-scaler state is not restored."
            )
        elif self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
            self.min_scale_stop.load_state_dict(state_dict.get("outcomes", {}))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also write the scale under ``MixedPrecision``'s key, so a run resumed with Lightning's plugin keeps it."""
        if self.scaler is not None:  # torch's own entries only, as MixedPrecision saves them
            checkpoint.setdefault("MixedPrecision", torch.amp.GradScaler.state_dict(self.scaler))

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the scaler state of a checkpoint written with Lightning's ``MixedPrecision("16-mixed")``."""
        torch_state = checkpoint.get("MixedPrecision")
        if self.scaler is not None and type(self).__qualname__ not in checkpoint and torch_state:
            self.load_state_dict(torch_state)
