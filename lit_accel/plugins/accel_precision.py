"""``AccelPrecision``: mixed precision with a visible, bounded, skip-aware loss scaler.

Fixes, relative to Lightning's ``MixedPrecision``: the scaler's settings are arguments (Lightning #17272); a skipped
step does not advance step-interval LR schedulers (#5558, #18828); a scale stuck at ``min_scale`` stops the run with an
explanation instead of skipping forever (DeepSpeed exits there too); ``"16-mixed"`` on CPU is real fp16 autocast with
a real ``GradScaler`` (Lightning silently turns it into bf16), so loss scaling is testable without a GPU; and bf16/fp32
steps with non-finite gradients are never written into the weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lit_accel.plugins._grad_scaler import DynamicGradScaler, ScalerStats, validate_scaler_args
from lit_accel.plugins._skip_aware_scheduler import make_skip_aware
from lit_accel.plugins._step_outcomes import StepOutcomes, Where
from lit_accel.utilities import _compat
from lit_accel.utilities._validation import check_bool, check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import LRSchedulerConfig

__all__ = ["AccelPrecision", "ScalerStats"]

_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")


class AccelPrecision(Precision):
    r"""Mixed-precision training with a configurable fp16 loss scaler, skip-aware LR schedulers and a non-finite guard.

    **What stays fp32.** Parameters, gradients and optimizer state stay fp32 ("fp32 master weights", Micikevicius et
    al., *Mixed Precision Training*, ICLR 2018): ``torch.autocast`` only runs matmuls and convolutions in fp16/bf16,
    which accumulate in fp32 inside the kernels (tensor cores, and CPU kernels likewise), and keeps reductions, losses
    and normalisations in fp32. Nothing is converted in place; checkpoints hold fp32 weights.

    **Loss scaling** (``"16-mixed"``). fp16 flushes gradients below 2**-24 to zero, so the loss is multiplied by a
    scale before ``backward`` and the gradients are divided by it (in fp32) before clipping and the optimizer step.
    ``precision.scaler`` is a :class:`~lit_accel.plugins._grad_scaler.DynamicGradScaler` (a ``torch.amp.GradScaler``):
    a step whose gradients contain inf/NaN is skipped (weights and optimizer state untouched); after ``hysteresis``
    consecutive overflows the scale is multiplied by ``backoff_factor``; after ``growth_interval`` clean steps by
    ``growth_factor``; it stays within ``[min_scale, max_scale]``. An overflow while the scale is already at
    ``min_scale`` raises (or warns once, ``on_min_scale="warn"``) instead of skipping forever. ``dynamic=False``
    keeps the scale at ``init_scale`` (static loss scaling; ``init_scale=1.0`` disables scaling), still skipping
    overflowing steps; ``min_scale`` then does not apply.

    **Skipped steps.** ``trainer.global_step`` counts *attempted* optimizer steps, skipped ones included
    (Lightning's own behaviour, kept so that ``max_steps`` budgets stay predictable); ``precision.skipped_steps``
    counts the skipped ones. Step-interval LR schedulers (``"interval": "step"``) are not advanced on a skipped step:
    ``connect()`` makes their ``step()`` a no-op after a skipped optimizer step (their class is swapped for a
    subclass; ``state_dict`` and pickling are unchanged). Epoch-interval schedulers are left alone.

    **Non-finite guard** (``"bf16-mixed"`` and ``"32-true"``). bf16 has fp32's exponent range, so there is no loss
    scaling (``precision.scaler is None``), but a NaN/inf gradient would still be written into the weights. An
    internal non-scaling ``DynamicGradScaler`` (scale fixed at 1.0) checks the gradients and skips such a step;
    ``on_nonfinite="raise"`` (default) then raises with the step and batch index, ``"skip"`` counts it in
    ``skipped_steps`` and continues. The guard runs the closure (forward and backward) before ``step()``, so
    optimizers that re-evaluate the closure inside ``step()`` cannot be guarded: ``torch.optim.LBFGS`` runs unguarded,
    with a warning; for others (SAM-style optimizers) pass ``on_nonfinite="off"``, which the error says if their
    ``step()`` complains about a missing closure.

    **Several optimizers per batch** (manual optimization: ``manual_backward(loss); opt1.step(); opt2.step()``, or a
    GAN's two passes). The scale is updated after every optimizer step, as in Lightning, so ``hysteresis``,
    ``growth_interval`` and ``skipped_steps`` count optimizer steps. Unlike Lightning (and torch's ``GradScaler``),
    every optimizer unscales its gradients with the scale they were computed with (the scale at the last backward),
    not with a scale an earlier optimizer's update has already changed: Lightning's ``MixedPrecision`` halves or
    doubles the second optimizer's gradients whenever the first step moved the scale. An overflow in one optimizer's
    gradients skips only that optimizer's step. An optimizer with no gradients (its parameters took no part in the
    batch's backward) is stepped plainly, outside the scaler.

    **Gradient clipping** acts on unscaled gradients. For fused optimizers (``AdamW(fused=True)`` etc.), which
    unscale inside their kernel, the gradients are unscaled first only when clipping is requested (one extra pass
    over the gradients, no sync); ``on_before_optimizer_step`` then sees scaled gradients, as with Lightning.
    Optimizers on torch's deprecated ``step(grad_scaler=...)`` contract unscale by themselves and are refused with
    clipping.

    **Host syncs per optimizer step** (all other bookkeeping stays on the device):

    ===========================================  ========  ===================================================
    configuration                                syncs     why
    ===========================================  ========  ===================================================
    fp16 or guard, non-fused optimizer           1         ``GradScaler.step`` reads found-inf (``.item()``) to
                                                           decide whether to call ``optimizer.step()``; the
                                                           plugin reuses that value. fp16: +1 on overflow steps
                                                           only (reads the scale for the min-scale check).
    fp16, fused optimizer                        0         the kernel skips on the device; the min-scale counter
                                                           is read every ``min_scale_check_interval`` steps.
    guard, fused, ``on_nonfinite="skip"``        0         the kernel skips on the device.
    guard, fused, ``on_nonfinite="raise"``       0         the kernel skips on the device; the flag is copied to
                                                           pinned host memory without a sync and checked two
                                                           steps later (or at the end of fit), on every rank
                                                           at the same step; the error names the bad step.
    any fused + a step-interval LR scheduler     1         the scheduler must know whether the step was skipped.
    ===========================================  ========  ===================================================

    Reading ``skipped_steps`` or ``loss_scale`` syncs; ``scaler_stats()`` does not.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling), ``"bf16-mixed"`` (bf16 autocast + guard) or
            ``"32-true"`` (no autocast, guard only).
        device: ``"cpu"`` or ``"cuda"``; ``None`` (default) takes the Trainer's device in ``connect()``. With
            ``"cpu"`` the scaler exists from construction; on CUDA it is created in ``connect()`` on the rank's GPU
            (``connect()`` refuses a Trainer on another device type).
        init_scale: initial loss scale (fp16).
        growth_factor: scale multiplier after ``growth_interval`` consecutive clean steps (> 1).
        backoff_factor: scale multiplier after ``hysteresis`` consecutive overflows (in (0, 1)).
        growth_interval: consecutive clean steps before the scale grows.
        hysteresis: consecutive overflowing steps skipped before the scale backs off (DeepSpeed's ``hysteresis``
            with ``consecutive_hysteresis=True``); 1 is torch's behaviour.
        min_scale: lowest scale; an overflow there triggers ``on_min_scale``.
        max_scale: highest scale (keeps a never-overflowing run from growing the scale to inf).
        dynamic: ``False`` for static loss scaling at ``init_scale``.
        on_min_scale: ``"raise"`` a ``RuntimeError`` (default) or ``"warn"`` once and keep skipping at ``min_scale``.
        on_nonfinite: bf16/fp32 steps with inf/NaN gradients: ``"raise"`` (default: with bf16's range this is a
            bug or divergence, not a calibration event, and silently skipping hides it), ``"skip"`` and count, or
            ``"off"``: no guard, the closure is passed to ``optimizer.step()`` as Lightning does (for optimizers
            that re-evaluate it inside ``step()``, such as SAM).
        min_scale_check_interval: with fused optimizers, read the min-scale counter every this many steps.

    Raises:
        ValueError: unknown ``precision``/``device``/option string, or a scaler setting out of range (the message
            names the value and the allowed range).
        TypeError: an argument of the wrong type; in ``connect()``: ``LBFGS`` with ``"16-mixed"``.
        RuntimeError: at run time, the scale reached ``min_scale`` and still overflows (``on_min_scale="raise"``),
            or bf16/fp32 gradients are non-finite (``on_nonfinite="raise"``).

    Example::

        from lightning.pytorch import Trainer
        from lit_accel import AccelDDP, AccelPrecision, LossScaleMonitor

        trainer = Trainer(
            accelerator="gpu",
            devices=8,
            strategy=AccelDDP(),
            plugins=[AccelPrecision("16-mixed", hysteresis=2, growth_interval=1000)],
            callbacks=[LossScaleMonitor()],
        )
        # On CPU, for tests: Trainer(accelerator="cpu", plugins=[AccelPrecision("16-mixed")]) is real fp16.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "32-true"],
        device: Literal["cpu", "cuda"] | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
        on_min_scale: Literal["raise", "warn"] = "raise",
        on_nonfinite: Literal["raise", "skip", "off"] = "raise",
        min_scale_check_interval: int = 100,
    ) -> None:
        name = type(self).__name__
        check_choice(
            name,
            "precision",
            precision,
            _PRECISIONS,
            "'bf16-mixed' where the hardware supports bf16 (NVIDIA Ampere or newer), else '16-mixed'",
        )
        check_choice(name, "device", device, (None, "cpu", "cuda"), "None, to follow the Trainer's device")
        check_choice(name, "on_min_scale", on_min_scale, ("raise", "warn"), "'raise' (the default)")
        check_choice(name, "on_nonfinite", on_nonfinite, ("raise", "skip", "off"), "'raise' (the default)")
        check_bool(name, "dynamic", dynamic)
        validate_scaler_args(
            name, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        check_int(name, "min_scale_check_interval", min_scale_check_interval, example=100)
        self.precision = precision  # type: ignore[assignment]
        self._scaler_kwargs: dict[str, Any] = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
        )
        self._device_type = device
        self._device: torch.device | None = None
        #: The fp16 loss scaler (``None`` for bf16/fp32, and for fp16 until ``connect()`` when ``device=None``).
        self.scaler: DynamicGradScaler | None = None
        self._guard: DynamicGradScaler | None = None  # non-scaling scaler: the bf16/fp32 non-finite check
        self._pending_state: dict[str, Any] | None = None
        self._outcomes = StepOutcomes(name, precision, on_min_scale, on_nonfinite, min_scale_check_interval)
        self._without_backward = False
        if device == "cpu":
            # Only on CPU: CUDA tensors created before a fork-based launcher (ddp_fork, notebooks) starts its workers
            # would break CUDA there, and the rank's GPU is only known in connect().
            self._build(torch.device("cpu"))

    # ------------------------------------------------------------------ public state

    @property
    def on_min_scale(self) -> Literal["raise", "warn"]:
        """What an overflow at ``min_scale`` does: ``"raise"`` or ``"warn"``."""
        return self._outcomes.on_min_scale

    @on_min_scale.setter
    def on_min_scale(self, value: Literal["raise", "warn"]) -> None:
        check_choice(type(self).__name__, "on_min_scale", value, ("raise", "warn"), "'raise' (the default)")
        self._outcomes.on_min_scale = value

    @property
    def on_nonfinite(self) -> Literal["raise", "skip", "off"]:
        """What the bf16/fp32 guard does with non-finite gradients: ``"raise"``, ``"skip"`` or ``"off"``."""
        return self._outcomes.on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, value: Literal["raise", "skip", "off"]) -> None:
        check_choice(type(self).__name__, "on_nonfinite", value, ("raise", "skip", "off"), "'raise' (the default)")
        self._outcomes.on_nonfinite = value

    @property
    def min_scale_check_interval(self) -> int:
        """With fused optimizers, the min-scale counter is read every this many optimizer steps."""
        return self._outcomes.min_scale_check_interval

    @min_scale_check_interval.setter
    def min_scale_check_interval(self, value: int) -> None:
        check_int(type(self).__name__, "min_scale_check_interval", value, example=100)
        self._outcomes.min_scale_check_interval = value

    @property
    def device(self) -> torch.device | None:
        """The device of the scaler and of autocast, once known."""
        return self._device

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (fp16 overflows, or the guard's skips). Syncs."""
        scaler = self._active_scaler
        if scaler is None:
            return int((self._pending_state or {}).get(self._state_key, {}).get("skipped_steps", 0))
        return int(scaler.counter("skipped_steps").item())

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (before setup: the one it will start from); ``1.0`` for bf16/fp32. Syncs."""
        if self.precision != "16-mixed":
            return 1.0
        if self.scaler is None:
            pending = (self._pending_state or {}).get("scaler") or {}
            return float(pending.get("scale", self._scaler_kwargs["init_scale"]))
        return self.scaler.get_scale()

    def scaler_stats(self) -> ScalerStats:
        """Scale and counters as 0-d device tensors, read without a host sync (see ``ScalerStats``).

        For bf16/fp32 these are the guard's (scale 1.0; ``skipped_steps`` counts non-finite skips).

        Raises:
            RuntimeError: called before the Trainer set the plugin up (``device=None`` and no ``connect()`` yet).
        """
        scaler = self._active_scaler
        if scaler is None:
            raise RuntimeError(
                f"{type(self).__name__}.scaler_stats(): the scaler is created when the Trainer sets the plugin up"
                " (or at construction with device='cpu'/'cuda'); call it during or after fit()."
            )
        return scaler.stats()

    # ------------------------------------------------------------------ setup

    @property
    def _active_scaler(self) -> DynamicGradScaler | None:
        return self.scaler if self.precision == "16-mixed" else self._guard

    @property
    def _state_key(self) -> str:
        return "scaler" if self.precision == "16-mixed" else "guard"

    def _build(self, device: torch.device) -> None:
        """Create (or move) the scaler on ``device`` and apply state loaded before it existed."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        old = self._active_scaler
        if old is not None and old.device == device:
            return
        if self.precision == "16-mixed":
            new = DynamicGradScaler(device, **self._scaler_kwargs)
        else:
            kwargs = dict(self._scaler_kwargs, init_scale=1.0, min_scale=1.0, max_scale=1.0, dynamic=False)
            new = DynamicGradScaler(device, **kwargs)
        if old is not None:
            new.load_state_dict(old.state_dict())
        self._device = device
        if self.precision == "16-mixed":
            self.scaler = new
        else:
            self._guard = new
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[nn.Module, list[Optimizer], list[LRSchedulerConfig]]:
        """Create the scaler on the Trainer's device, refuse unsupported optimizers, make schedulers skip-aware."""
        name = type(self).__name__
        module = _find_lightning_module(model)
        trainer = _trainer_of(module)
        if trainer is not None:
            device = trainer.strategy.root_device
        else:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{name} supports CPU and CUDA devices; the Trainer runs on {device}.")
        if self._device_type is not None and device.type != self._device_type:
            raise RuntimeError(
                f"{name}(device={self._device_type!r}) but the Trainer runs on {device}; pass device=None (the"
                " default) to follow the Trainer."
            )
        self._build(device)

        raw = [_unwrap(opt) for opt in optimizers]
        if self.precision == "16-mixed" and any(isinstance(opt, LBFGS) for opt in raw):
            raise TypeError(
                f"{name}('16-mixed') cannot drive torch.optim.LBFGS: LBFGS re-evaluates the closure inside step(),"
                " where the loss scaler cannot unscale or check the gradients. Use precision='bf16-mixed' or"
                " '32-true', or another optimizer."
            )
        if any(isinstance(opt, LBFGS) for opt in raw):
            rank_zero_warn(
                f"{name}({self.precision!r}): torch.optim.LBFGS re-evaluates the closure inside step(), so its"
                " steps are not checked for non-finite gradients."
            )
        clip_val = trainer.gradient_clip_val if trainer is not None else None
        legacy = [type(opt).__name__ for opt in raw if _compat.optimizer_takes_grad_scaler(opt)]
        if clip_val and legacy and self.precision == "16-mixed":
            raise ValueError(_legacy_clip_message(name, legacy[0], clip_val))

        self._outcomes.scheduled = set()
        for config in lr_schedulers:
            if config.interval == "step":
                opt = getattr(config.scheduler, "optimizer", None)
                if make_skip_aware(config.scheduler, self):
                    self._outcomes.scheduled.add(id(_unwrap(opt)) if opt is not None else None)
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ autocast and backward

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``torch.autocast`` in fp16/bf16 on the plugin's device; nothing for ``"32-true"``."""
        if self.precision == "32-true":
            yield
            return
        device_type = self._device.type if self._device is not None else (self._device_type or "cpu")
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        # cache_enabled=False as in Lightning's MixedPrecision: weights are re-cast on every use inside the context.
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None and self.precision == "16-mixed":
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    # ------------------------------------------------------------------ optimizer step

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self._active_scaler
        unguarded = scaler is self._guard and self.on_nonfinite == "off"
        if scaler is None or unguarded or isinstance(optimizer, LBFGS):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._outcomes.raise_lagged_nonfinite()
        closure_result = closure()
        # training_step returned None: there was no backward, so nothing to unscale or step (as Lightning).
        without_backward = closure_result is None and model.automatic_optimization
        # Manual optimization may step an optimizer whose parameters this iteration's backward did not reach: the
        # scaler has nothing to check (torch's GradScaler would assert), so it is stepped plainly, as Lightning's
        # bf16/fp32 would. The scan stops at the first gradient, in practice the first parameter.
        no_grads = not model.automatic_optimization and not _has_grads(optimizer)
        if without_backward or no_grads:
            self._outcomes.not_stepped(optimizer)  # step-interval schedulers move, as in Lightning
        if (
            not without_backward
            and not no_grads
            and scaler is self.scaler
            and not _compat.optimizer_handles_amp_scaling(optimizer)
            and not _compat.grad_scaler_grads_unscaled(scaler, optimizer)
        ):
            # Unscale before the hooks and clipping see the gradients. One foreach kernel, no sync.
            scaler.unscale_(optimizer)
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
        trainer = model.trainer
        at: Where = (trainer.global_step, _compat.train_batch_idx(trainer))
        scaler.update()
        self._outcomes.stepped(scaler, optimizer, is_guard=scaler is not self.scaler, at=at)
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
        optimizer = _unwrap(optimizer)
        scaler = self.scaler if self.precision == "16-mixed" else None
        if scaler is not None and not self._without_backward:
            if _compat.optimizer_takes_grad_scaler(optimizer):
                raise RuntimeError(_legacy_clip_message(type(self).__name__, type(optimizer).__name__, clip_val))
            if not _compat.grad_scaler_grads_unscaled(scaler, optimizer):
                scaler.unscale_(optimizer)  # also covers manual optimization's self.clip_gradients(...)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def _should_skip_scheduler(self, optimizer: Optimizer | None) -> bool:
        return self._outcomes.should_skip_scheduler(None if optimizer is None else _unwrap(optimizer))

    # ------------------------------------------------------------------ messages

    @override
    def teardown(self) -> None:
        """Report a non-finite step of the last steps that had not reached the host yet (fused optimizers)."""
        try:
            if sys.exc_info()[0] is None:  # never mask an exception that is already ending the fit
                self._outcomes.raise_lagged_nonfinite(wait=True)
        finally:
            self._outcomes.reset()
            super().teardown()

    def _closure_message(self, optimizer: Optimizer) -> str:
        return (
            f"{type(self).__name__}({self.precision!r}): {type(optimizer).__name__}.step() needs the closure, but the"
            " loss scaler / non-finite guard runs the closure (forward and backward) before step() and calls step()"
            " without it. Fix: for bf16-mixed/32-true pass on_nonfinite='off' (no guard; the closure is passed to"
            " step() as in Lightning); '16-mixed' cannot drive such an optimizer (use 'bf16-mixed')."
        )

    # ------------------------------------------------------------------ checkpointing

    @override
    def state_dict(self) -> dict[str, Any]:
        """Scaler (or guard) state, counters, hysteresis streak and the host-side overflow history."""
        scaler = self._active_scaler
        if scaler is None:
            return dict(self._pending_state or {})
        return {"precision": self.precision, self._state_key: scaler.state_dict(), **self._outcomes.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``; before the scaler exists the state is kept and applied when it is created."""
        if self._active_scaler is None:
            self._pending_state = dict(state_dict)
            return
        saved = state_dict.get(self._state_key)
        if state_dict.get("precision", self.precision) != self.precision or not saved:
            rank_zero_warn(
                f"{type(self).__name__}({self.precision!r}): the checkpoint was saved with"
                f" precision={state_dict.get('precision')!r}; its loss-scaler state is not restored."
            )
            return
        self._active_scaler.load_state_dict(saved)
        self._outcomes.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the scaler state of a checkpoint written with Lightning's ``MixedPrecision("16-mixed")``."""
        torch_state = checkpoint.get("MixedPrecision")
        if self.precision == "16-mixed" and type(self).__qualname__ not in checkpoint and torch_state:
            self.load_state_dict({"precision": "16-mixed", "scaler": torch_state})


# ---------------------------------------------------------------------- helpers


def _legacy_clip_message(owner: str, optimizer: str, clip_val: float) -> str:
    return (
        f"{owner}('16-mixed'): gradient clipping (clip value {clip_val}) with {optimizer}, which unscales its"
        " gradients itself inside step(grad_scaler=...), would clip scaled gradients. Use a torch optimizer with"
        " fused=True (AccelPrecision unscales before clipping for those), a non-fused optimizer, or no clipping."
    )


def _has_grads(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # "not attached to a Trainer"
        return None


def _find_lightning_module(model: nn.Module) -> pl.LightningModule | None:
    """The LightningModule inside a strategy's wrappers (DDP -> Lightning's wrapper -> module)."""
    import lightning.pytorch as pl

    current: Any = model
    for _ in range(8):  # bounded: wrappers nest a few levels at most
        if current is None or isinstance(current, pl.LightningModule):
            return current
        inner = getattr(current, "module", None)
        current = inner if inner is not None else getattr(current, "_forward_module", None)
    return None
