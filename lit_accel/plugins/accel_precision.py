"""``AccelPrecision``: Lightning's mixed precision with an injected, bounded, skip-aware loss scaler and a NaN guard."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lit_accel.plugins import _precision_support as support
from lit_accel.plugins._precision_float8 import Float8Training, float8_conversion
from lit_accel.plugins._step_outcomes import StepOutcomes, Where
from lit_accel.plugins.float8 import Float8Conversion, Float8Report, ModuleFilter
from lit_accel.plugins.grad_scaler import DynamicGradScaler
from lit_accel.protocols import ScalerStats
from lit_accel.utilities import _compat, _workarounds
from lit_accel.utilities._validation import check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import LRSchedulerConfig
    from torchao.float8 import Float8LinearConfig

__all__ = ["AccelPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed", "fp8-mixed", "32-true")
_MIXED = ("16-mixed", "bf16-mixed", "fp8-mixed")


class AccelPrecision(Precision, metaclass=support.MixedVariantCall):
    """Mixed precision with a configurable fp16 loss scaler, skip-aware LR schedulers and a non-finite guard.

    A drop-in for Lightning's ``MixedPrecision``: for ``"16-mixed"``/``"bf16-mixed"`` the instance *is* a
    ``MixedPrecision`` (same ``precision``, ``device`` string, ``scaler``, ``autocast_context_manager()`` and
    checkpoint keys, readable both ways); ``"32-true"`` behaves as Lightning's plain ``Precision``. Parameters,
    gradients and optimizer state stay fp32. For ``"16-mixed"`` a step with inf/NaN gradients is skipped and does not
    advance step-interval LR schedulers; a scale stuck at the scaler's ``min_scale`` stops the run with an
    explanation. For bf16/fp32 a guard keeps non-finite gradients out of the weights. Real fp16 works on CPU, so loss
    scaling is testable without a GPU. Details, host-sync table and the multi-optimizer rule: ``docs/precision.md``.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"fp8-mixed"`` (torchao FP8 Linear layers, bf16 autocast for the
            rest; emulated on CPU) or ``"32-true"``.
        device: ``"cpu"`` or ``"cuda"``; ``None`` follows the Trainer's device (set in ``connect()``).
        scaler: the fp16 loss scaler: a :class:`~lit_accel.DynamicGradScaler` (default ``DynamicGradScaler()``), or
            a ``torch.amp.GradScaler``, adopted with its settings and state (torch's rule). Only for ``"16-mixed"``.
        float8: ``"fp8-mixed"`` only: torchao's ``Float8LinearConfig`` (default: dynamic tensorwise scaling), or a
            :class:`~lit_accel.plugins.Float8Conversion` (also sets ``emulate``). ``docs/precision.md``.
        float8_filter: ``"fp8-mixed"`` only: a callable ``(module, name) -> bool`` choosing the Linear layers to
            convert, or names (fnmatch patterns) of modules to leave out, e.g. ``["head"]``.
        on_nonfinite: bf16/fp32 steps with inf/NaN gradients: ``"raise"`` (default), ``"skip"`` and count, or
            ``"off"`` (no guard; for optimizers that re-evaluate the closure inside ``step()``, such as SAM).
        on_min_scale: an overflow at the scaler's ``min_scale``: ``"raise"`` (default) or ``"warn"`` once.
        min_scale_check_interval: with fused optimizers, read the min-scale counter every this many steps.

    Raises:
        ValueError: an unknown option, or a scaler with ``"bf16-mixed"``/``"32-true"``.
        TypeError: ``scaler`` is not a ``torch.amp.GradScaler``; in ``connect()``: ``LBFGS`` with ``"16-mixed"``.
        RuntimeError: at run time, the scale is at ``min_scale`` and still overflows (``on_min_scale="raise"``),
            or bf16/fp32 gradients are non-finite (``on_nonfinite="raise"``).

    Example::

        from lit_accel import AccelPrecision, DynamicGradScaler

        plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(hysteresis=2, growth_interval=1000))
        trainer = Trainer(accelerator="gpu", devices=8, strategy="accel_ddp", plugins=[plugin])
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "fp8-mixed", "32-true"],
        device: Literal["cpu", "cuda"] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        float8: Float8LinearConfig | Float8Conversion | None = None,
        float8_filter: ModuleFilter | None = None,
        on_nonfinite: Literal["raise", "skip", "off"] = "raise",
        on_min_scale: Literal["raise", "warn"] = "raise",
        min_scale_check_interval: int = 100,
    ) -> None:
        name = type(self).__name__
        check_choice(name, "precision", precision, _PRECISIONS, "'bf16-mixed' (Ampere or newer), else '16-mixed'")
        check_choice(name, "device", device, (None, "cpu", "cuda"), "None, to follow the Trainer's device")
        check_choice(name, "on_min_scale", on_min_scale, ("raise", "warn"), "'raise'")
        check_choice(name, "on_nonfinite", on_nonfinite, ("raise", "skip", "off"), "'raise'")
        check_int(name, "min_scale_check_interval", min_scale_check_interval, example=100)
        self.precision = precision  # type: ignore[assignment]
        self._device_arg = device
        self._root: torch.device | None = None
        conversion = float8_conversion(name, precision, float8, float8_filter)
        self._float8 = None if conversion is None else Float8Training(conversion)
        self._outcomes = StepOutcomes(name, precision, on_min_scale, on_nonfinite, min_scale_check_interval)
        self._without_backward = False
        self._scaler: DynamicGradScaler | None = None
        # bf16/fp32: a non-scaling scaler (scale fixed at 1.0) that checks the gradients and skips non-finite steps.
        self._guard: DynamicGradScaler | None = None
        if precision == "16-mixed":
            self.scaler = DynamicGradScaler() if scaler is None else scaler
        else:
            owner = f"{name}({precision!r}, scaler={type(scaler).__name__}(...))"
            support.adopt_scaler(owner, precision, scaler)  # raises unless scaler is None
            self._guard = DynamicGradScaler(init_scale=1.0, min_scale=1.0, max_scale=1.0, dynamic=False)
        if device == "cpu":
            # Only on CPU: CUDA tensors created before a fork-based launcher starts its workers would break CUDA
            # there, and the rank's GPU is only known in connect().
            self._place(torch.device("cpu"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The mixed variant carries its base class's name: rebuild it through the base (ddp_spawn pickles plugins).
        return support.rebuild, (support.base_class(type(self)), self.precision in _MIXED), self.__dict__

    # ------------------------------------------------------------------ public state

    @property
    def scaler(self) -> DynamicGradScaler | None:
        """The fp16 loss scaler (``None`` for bf16/fp32). Assigning a ``torch.amp.GradScaler`` adopts it."""
        return self._scaler

    @scaler.setter
    def scaler(self, value: torch.amp.GradScaler | None) -> None:
        self._scaler = support.adopt_scaler(f"{type(self).__name__}({self.precision!r})", self.precision, value)
        if self._scaler is not None and self._root is not None:
            self._scaler.to(self._root)

    @property
    def device(self) -> str:
        """The autocast device type (``"cpu"`` or ``"cuda"``), as Lightning's ``MixedPrecision.device``."""
        if self._root is not None:
            return self._root.type
        return self._device_arg or ("cuda" if torch.cuda.is_available() else "cpu")

    @device.setter
    def device(self, value: str) -> None:
        check_choice(type(self).__name__, "device", value, ("cpu", "cuda"), "'cpu' or 'cuda'")
        self._device_arg = value  # type: ignore[assignment]

    @property
    def float8_report(self) -> Float8Report | None:
        """``"fp8-mixed"``: the Linear layers converted at setup and why the others were not (``None`` before)."""
        return None if self._float8 is None else self._float8.report

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled (``"16-mixed"``)."""
        return self.precision == "16-mixed"

    #: What an overflow at ``min_scale`` does: ``"raise"`` or ``"warn"`` (settable).
    on_min_scale = support.OutcomeSetting(("raise", "warn"))
    #: What the bf16/fp32 guard does with non-finite gradients: ``"raise"``, ``"skip"`` or ``"off"`` (settable).
    on_nonfinite = support.OutcomeSetting(("raise", "skip", "off"))
    #: With fused optimizers, the min-scale counter is read every this many optimizer steps (settable).
    min_scale_check_interval = support.OutcomeSetting(None)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (fp16 overflows, or the guard's skips). Syncs."""
        return int(self._active_scaler.state_dict()["skipped_steps"])

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (before setup: the one it will start from); ``1.0`` for bf16/fp32. Syncs."""
        return self._scaler.get_scale() if self._scaler is not None else 1.0

    def scaler_stats(self) -> ScalerStats:
        """Scale and counters as 0-d device tensors, read without a host sync (bf16/fp32: the guard's).

        Raises:
            RuntimeError: called before the Trainer placed the plugin on its device.
        """
        if self._active_scaler.device is None:
            raise RuntimeError(
                f"{type(self).__name__}.scaler_stats(): the scaler has no device before fit. Fix: call it during or"
                " after fit(), or construct the plugin with device='cpu'."
            )
        return self._active_scaler.stats()

    def step_was_skipped(self, optimizer: Optimizer | None = None) -> bool:
        """Whether the last step of ``optimizer`` (of any optimizer, for ``None``) was skipped."""
        return self._outcomes.should_skip_scheduler(None if optimizer is None else support.unwrap(optimizer))

    def autocast_context_manager(self) -> Any:
        """``torch.autocast`` in fp16/bf16 on the plugin's device (a no-op context for ``"32-true"``)."""
        if self.precision == "32-true":
            return nullcontext()
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        # cache_enabled=False as in Lightning's MixedPrecision: weights are re-cast on every use inside the context.
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    # ------------------------------------------------------------------ setup

    @property
    def _active_scaler(self) -> DynamicGradScaler:
        scaler = self._scaler if self.precision == "16-mixed" else self._guard
        assert scaler is not None
        return scaler

    def _place(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._root = device
        self._active_scaler.to(device)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[nn.Module, list[Optimizer], list[LRSchedulerConfig]]:
        """Place the scaler on the Trainer's device, refuse unsupported optimizers, make schedulers skip-aware."""
        name = type(self).__name__
        trainer = support.trainer_of(support.find_lightning_module(model))
        if trainer is not None:
            device = trainer.strategy.root_device
        else:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{name} supports CPU and CUDA devices; the Trainer runs on {device}.")
        if self._device_arg is not None and device.type != self._device_arg:
            raise RuntimeError(
                f"{name}(device={self._device_arg!r}) but the Trainer runs on {device}. Fix: pass device=None (the"
                " default) to follow the Trainer."
            )
        self._place(device)
        support.check_optimizers(name, self.precision, optimizers, trainer.gradient_clip_val if trainer else None)
        self._outcomes.scheduled = set()
        for config in lr_schedulers:
            if config.interval == "step":
                opt = getattr(config.scheduler, "optimizer", None)
                if _workarounds.make_skip_aware(config.scheduler, self):
                    self._outcomes.scheduled.add(id(support.unwrap(opt)) if opt is not None else None)
                elif _workarounds.applies("skip_aware_schedulers"):
                    rank_zero_warn(f"{name}: {type(config.scheduler).__name__} will also step on skipped steps.")
        return model, optimizers, lr_schedulers

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """``"fp8-mixed"``: convert the eligible Linear layers in place (before the strategy wraps or shards them)."""
        if self._float8 is None:
            return module
        trainer = support.trainer_of(support.find_lightning_module(module))
        device = trainer.strategy.root_device if trainer is not None else torch.device(self.device)
        return self._float8.convert(module, device)

    # ------------------------------------------------------------------ autocast and backward

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast in fp16/bf16 on the plugin's device; nothing for ``"32-true"``."""
        with self.autocast_context_manager():
            yield

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        """As ``forward_context``; ``"fp8-mixed"`` leaves inference mode (torchao's float8 tensors fail under it)."""
        with self._float8.eval_context() if self._float8 is not None else nullcontext(), self.forward_context():
            yield

    test_step_context = val_step_context
    predict_step_context = val_step_context

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.precision == "16-mixed" and self._scaler is not None:
            tensor = self._scaler.scale(tensor)
        return Precision.pre_backward(self, tensor, module)  # not MixedPrecision's, which would scale again

    # ------------------------------------------------------------------ optimizer step

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self._active_scaler
        guard = self.precision != "16-mixed"
        if (guard and self.on_nonfinite == "off") or isinstance(optimizer, LBFGS):
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        self._outcomes.raise_lagged_nonfinite()
        closure_result = closure()
        # training_step returned None: there was no backward, so nothing to unscale or step (as Lightning).
        without_backward = closure_result is None and model.automatic_optimization
        # Manual optimization may step an optimizer whose parameters this iteration's backward did not reach: the
        # scaler has nothing to check (torch's GradScaler would assert), so it is stepped plainly.
        no_grads = not model.automatic_optimization and not support.has_grads(optimizer)
        if without_backward or no_grads:
            self._outcomes.not_stepped(optimizer)  # step-interval schedulers move, as in Lightning
        elif (
            not guard
            and not _compat.optimizer_handles_amp_scaling(optimizer)
            and not _compat.grad_scaler_grads_unscaled(scaler, optimizer)
        ):
            scaler.unscale_(optimizer)  # before the hooks and clipping see the gradients; one foreach kernel, no sync
        self._without_backward = without_backward or no_grads
        try:
            self._after_closure(model, optimizer)
        finally:
            self._without_backward = False
        if without_backward:
            return closure_result
        if no_grads:
            return optimizer.step(**kwargs)
        try:
            output = scaler.step(optimizer, **kwargs)  # skips optimizer.step() (or the fused kernel) on inf/NaN
        except Exception as err:
            if "closure" in str(err).lower():
                raise RuntimeError(self._closure_message(optimizer)) from err
            raise
        at: Where = (model.trainer.global_step, _compat.train_batch_idx(model.trainer))
        scaler.update()
        self._outcomes.stepped(scaler, optimizer, is_guard=guard, at=at)
        return output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip unscaled gradients; for fused optimizers unscale them first (their kernel then gets no scale)."""
        if clip_val is None or clip_val <= 0:
            return
        optimizer = support.unwrap(optimizer)
        scaler = self._scaler if self.precision == "16-mixed" else None
        if scaler is not None and not self._without_backward:
            if _compat.optimizer_takes_grad_scaler(optimizer):
                raise RuntimeError(support.legacy_clip_message(type(self).__name__, type(optimizer).__name__, clip_val))
            if not _compat.grad_scaler_grads_unscaled(scaler, optimizer):
                scaler.unscale_(optimizer)  # also covers manual optimization's self.clip_gradients(...)
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def teardown(self) -> None:
        """Report a non-finite step of the last steps that had not reached the host yet (fused optimizers)."""
        try:
            if sys.exc_info()[0] is None:  # never mask an exception that is already ending the fit
                self._outcomes.raise_lagged_nonfinite(wait=True)
        finally:
            self._outcomes.reset()
            if self._float8 is not None:
                self._float8.revert()
            super().teardown()

    def _closure_message(self, optimizer: Optimizer) -> str:
        return (
            f"{type(self).__name__}({self.precision!r}): {type(optimizer).__name__}.step() needs the closure, which"
            " the scaler or guard has already run. Fix: pass on_nonfinite='off' (bf16-mixed/32-true only)."
        )

    # ------------------------------------------------------------------ checkpointing

    @override
    def state_dict(self) -> dict[str, Any]:
        """fp16: the scaler's state under torch's keys (as ``MixedPrecision``) plus counters and history.

        bf16/fp32: the guard's counters. Reading it syncs (checkpoint time only).
        """
        outcomes = {"outcomes": self._outcomes.state_dict(), "precision": self.precision}
        if self.precision == "16-mixed":
            return {**self._active_scaler.state_dict(), **outcomes}
        return {"guard": self._active_scaler.state_dict(), **outcomes}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``, a ``MixedPrecision``/``GradScaler`` state, or a lit_accel 0.1 checkpoint's."""
        saved_precision, scaler_state = support.scaler_state_of(state_dict, self.precision)
        if saved_precision != self.precision or not scaler_state:
            rank_zero_warn(
                f"{type(self).__name__}({self.precision!r}): the checkpoint was saved with"
                f" precision={saved_precision!r}; its loss-scaler state is not restored."
            )
            return
        self._active_scaler.load_state_dict(scaler_state)
        self._outcomes.load_state_dict(state_dict.get("outcomes", state_dict))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also write the scale under ``MixedPrecision``'s key, so a run resumed with Lightning's plugin keeps it."""
        if self.precision == "16-mixed":
            state = self._active_scaler.state_dict()
            checkpoint.setdefault("MixedPrecision", {key: state[key] for key in support.TORCH_SCALER_KEYS})

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the scaler state of a checkpoint written with Lightning's ``MixedPrecision("16-mixed")``."""
        torch_state = checkpoint.get("MixedPrecision")
        if self.precision == "16-mixed" and type(self).__qualname__ not in checkpoint and torch_state:
            self.load_state_dict(torch_state)
