"""What ``AccelPrecision`` needs around it: the MixedPrecision variant class, optimizer checks, checkpoint formats.

Kept apart so that ``accel_precision.py`` reads as the plugin's behaviour only.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import LBFGS, Optimizer

from lit_accel.plugins.grad_scaler import DynamicGradScaler
from lit_accel.utilities import _compat
from lit_accel.utilities._validation import check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = [
    "TORCH_SCALER_KEYS",
    "MixedVariantCall",
    "OutcomeSetting",
    "adopt_scaler",
    "base_class",
    "check_optimizers",
    "find_lightning_module",
    "has_grads",
    "legacy_clip_message",
    "mixed_variant",
    "rebuild",
    "scaler_state_of",
    "trainer_of",
    "unwrap",
]

#: The entries of a ``torch.amp.GradScaler`` state dict, which Lightning's ``MixedPrecision`` saves.
TORCH_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

# ---------------------------------------------------------------------- the MixedPrecision variant

_MIXED_VARIANTS: dict[type, type] = {}
_MIXED = ("16-mixed", "bf16-mixed", "fp8-mixed")


class MixedVariantCall(type):
    """Metaclass: calling the class with ``"16-mixed"``/``"bf16-mixed"`` builds its ``MixedPrecision`` variant.

    So every ``isinstance(plugin, MixedPrecision)`` in Lightning and user code sees mixed precision. A metaclass
    rather than ``__new__``, so that ``__init__`` stays the signature that LightningCLI and ``inspect`` read.
    """

    @property
    def __signature__(cls) -> inspect.Signature:
        # inspect.signature(cls) would otherwise report this __call__'s (*args, **kwargs).
        signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        precision = args[0] if args else kwargs.get("precision")
        if precision in _MIXED and not issubclass(cls, MixedPrecision):
            cls = mixed_variant(cls)
        return super().__call__(*args, **kwargs)


def mixed_variant(cls: type) -> type:
    """A cached subclass of ``cls`` and ``MixedPrecision`` with ``cls``'s name (and so its checkpoint key)."""
    variant = _MIXED_VARIANTS.get(cls)
    if variant is None:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        variant = type(cls.__name__, (cls, MixedPrecision), namespace)
        _MIXED_VARIANTS[cls] = variant
    return variant


def base_class(cls: type) -> type:
    """The class a variant was made from (``cls`` itself otherwise): pickling goes through it."""
    return next((base for base, variant in _MIXED_VARIANTS.items() if variant is cls), cls)


def rebuild(cls: type, mixed: bool) -> Any:
    """Unpickle: a new, uninitialised instance of ``cls`` or of its mixed variant."""
    return object.__new__(mixed_variant(cls) if mixed else cls)


# ---------------------------------------------------------------------- settings


def adopt_scaler(owner: str, precision: str, value: object) -> DynamicGradScaler | None:
    """The scaler a plugin of ``precision`` uses for ``value``: a ``DynamicGradScaler`` as is, a ``GradScaler`` adopted.

    Raises:
        ValueError: a scaler for bf16/fp32, or ``None`` for fp16. TypeError: not a ``torch.amp.GradScaler``.
    """
    if value is None:
        if precision == "16-mixed":
            raise ValueError(
                f"{owner}.scaler = None: fp16 needs a loss scaler. Fix: use DynamicGradScaler(init_scale=1.0,"
                " dynamic=False) for no scaling, or precision='bf16-mixed'."
            )
        return None
    if precision != "16-mixed":
        raise ValueError(f"{owner}: only '16-mixed' scales the loss. Fix: drop scaler, or use precision='16-mixed'.")
    if not isinstance(value, torch.amp.GradScaler):
        raise TypeError(f"{owner}(scaler={value!r}): expected a torch.amp.GradScaler. Fix: pass DynamicGradScaler().")
    if not isinstance(value, DynamicGradScaler):
        rank_zero_info(
            f"{owner}: adopting {type(value).__name__}(init_scale={value.get_scale():g}) as a DynamicGradScaler with"
            " its settings and state (torch's rule: hysteresis 1, unbounded scale); use precision.scaler from now on."
        )
        value = DynamicGradScaler.from_grad_scaler(value)
    return value


class OutcomeSetting:
    """A plugin attribute kept on its ``StepOutcomes`` and validated on assignment (``None``: a positive int)."""

    def __init__(self, allowed: tuple[str, ...] | None) -> None:
        self.allowed = allowed

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj._outcomes, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        owner = type(obj).__name__
        if self.allowed is None:
            check_int(owner, self.name, value, example=100)
        else:
            check_choice(owner, self.name, value, self.allowed, repr(self.allowed[0]))
        setattr(obj._outcomes, self.name, value)


# ---------------------------------------------------------------------- optimizers


def check_optimizers(owner: str, precision: str, optimizers: list[Any], clip_val: float | None) -> None:
    """Refuse optimizers the precision cannot drive; warn for LBFGS under the guard.

    Raises:
        TypeError: LBFGS with ``"16-mixed"``. ValueError: clipping with an optimizer that unscales by itself.
    """
    raw = [unwrap(opt) for opt in optimizers]
    if any(isinstance(opt, LBFGS) for opt in raw):
        if precision == "16-mixed":
            raise TypeError(
                f"{owner}('16-mixed') cannot drive torch.optim.LBFGS, which re-evaluates the closure inside step()"
                " where the scaler cannot unscale. Fix: use precision='bf16-mixed' or '32-true'."
            )
        rank_zero_warn(f"{owner}({precision!r}): torch.optim.LBFGS steps are not checked for inf/NaN.")
    legacy = [type(opt).__name__ for opt in raw if _compat.optimizer_takes_grad_scaler(opt)]
    if clip_val and legacy and precision == "16-mixed":
        raise ValueError(legacy_clip_message(owner, legacy[0], clip_val))


def legacy_clip_message(owner: str, optimizer: str, clip_val: float) -> str:
    return (
        f"{owner}('16-mixed'): clipping (gradient_clip_val={clip_val}) with {optimizer}, which unscales inside"
        " step(grad_scaler=...), would clip scaled gradients. Fix: use a torch optimizer with fused=True or no"
        " clipping."
    )


def has_grads(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# ---------------------------------------------------------------------- checkpoints


def scaler_state_of(state_dict: dict[str, Any], precision: str) -> tuple[str | None, dict[str, Any] | None]:
    """``(saved precision, scaler state)`` of a plugin's saved state.

    Accepts ``AccelPrecision``'s (flat, or lit_accel 0.1's nested one), ``MixedPrecision``'s or a bare ``GradScaler``'s.
    """
    saved = state_dict.get("precision", "16-mixed" if "scale" in state_dict else None)
    if precision != "16-mixed":
        return saved, state_dict.get("guard")
    nested = state_dict.get("scaler")
    return saved, nested if nested is not None else (state_dict if "scale" in state_dict else None)


# ---------------------------------------------------------------------- the Trainer behind a model


def trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # "not attached to a Trainer"
        return None


def find_lightning_module(model: nn.Module) -> pl.LightningModule | None:
    """The LightningModule inside a strategy's wrappers (DDP -> Lightning's wrapper -> module)."""
    import lightning.pytorch as pl

    current: Any = model
    for _ in range(8):  # bounded: wrappers nest a few levels at most
        if current is None or isinstance(current, pl.LightningModule):
            return current
        inner = getattr(current, "module", None)
        current = inner if inner is not None else getattr(current, "_forward_module", None)
    return None
