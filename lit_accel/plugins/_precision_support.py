"""What ``AccelPrecision`` checks around it: precision spellings, scalers, optimizers, saved states, the Trainer.

Kept apart so that ``accel_precision.py`` reads as the plugin's behaviour only.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import LBFGS, Optimizer

from lit_accel.plugins.float8 import Float8Conversion
from lit_accel.utilities import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

__all__ = [
    "check_optimizers",
    "check_scaler",
    "float8_conversion",
    "has_grads",
    "refuse_self_unscaling",
    "resolve_precision",
    "scaler_state_of",
    "trainer_of",
    "unwrap",
]

# Every spelling Lightning's Trainer accepts for the precisions AccelPrecision implements, to the canonical one.
_SPELLINGS = {"16-mixed": "16-mixed", "16": "16-mixed", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
              "fp8-mixed": "fp8-mixed"}  # fmt: skip
# Spellings Lightning's Trainer accepts that are not mixed precision: its own plugins run them.
_LIGHTNING_ONLY = ("32", "32-true", "64", "64-true", "16-true", "bf16-true")


def resolve_precision(owner: str, value: object) -> str:
    """The canonical precision for ``value`` (``16`` is ``"16-mixed"``); ValueError naming the closest one else."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else repr(value)
    if text in _SPELLINGS:
        return _SPELLINGS[text]
    if text in _LIGHTNING_ONLY:
        guard = ", and callbacks=[NonFiniteGuard()] to keep inf/NaN gradients from the weights" * text.startswith("32")
        raise ValueError(
            f"{owner}(precision={value!r}): not mixed precision, which is all this plugin adds; Lightning's own"
            f" plugin runs it. Fix: drop the plugin and pass Trainer(precision={text!r}){guard}."
        )
    # "fp16-mixed" means "16-mixed", though difflib finds "bf16-mixed" closer.
    stripped = text.lower().removeprefix("fp")
    close = [stripped] if stripped in _SPELLINGS else difflib.get_close_matches(text, list(_SPELLINGS), 1, 0.5)
    hint = f" Did you mean {_SPELLINGS[close[0]]!r}?" if close else ""
    raise ValueError(
        f"{owner}(precision={value!r}): expected '16-mixed', 'bf16-mixed' or 'fp8-mixed' (or Lightning's 16 and"
        f" 'bf16').{hint} Fix: pass precision={_SPELLINGS[close[0]] if close else '16-mixed'!r}."
    )


def check_scaler(owner: str, precision: str, scaler: object) -> None:
    """Raises ValueError for a scaler with bf16/FP8, TypeError for one that is not a ``torch.amp.GradScaler``."""
    if scaler is None:
        return
    if precision != "16-mixed":
        raise ValueError(
            f"{owner}({precision!r}, scaler={type(scaler).__name__}(...)): only '16-mixed' scales the loss. Fix: drop"
            " scaler, or use precision='16-mixed'."
        )
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"{owner}(scaler={scaler!r}): expected a torch.amp.GradScaler. Fix: pass DynamicGradScaler().")


def float8_conversion(owner: str, precision: str, float8: Any, float8_filter: Any) -> Float8Conversion | None:
    """``"fp8-mixed"``'s conversion from ``float8`` (a ``Float8LinearConfig`` or a ready conversion) and the filter."""
    given = "float8" if float8 is not None else "float8_filter" if float8_filter is not None else None
    if precision != "fp8-mixed" and given:
        raise ValueError(
            f"{owner}({precision!r}, {given}=...): FP8 settings only apply to 'fp8-mixed'. Fix: pass"
            f" precision='fp8-mixed', or drop {given}."
        )
    if not isinstance(float8, Float8Conversion):
        return Float8Conversion(float8, module_filter=float8_filter) if precision == "fp8-mixed" else None
    if float8_filter is not None:
        raise ValueError(
            f"{owner}('fp8-mixed', float8=Float8Conversion(...), float8_filter=...): the conversion has its own"
            " module_filter. Fix: pass Float8Conversion(config, module_filter=...) alone."
        )
    return float8


def check_optimizers(owner: str, optimizers: list[Any], clip_val: float | None) -> None:
    """Refuse optimizers fp16 loss scaling cannot drive (LBFGS; with clipping, self-unscaling ones) before a step."""
    raw = [unwrap(opt) for opt in optimizers]
    if any(isinstance(opt, LBFGS) for opt in raw):
        raise TypeError(
            f"{owner}('16-mixed') cannot drive torch.optim.LBFGS, which re-evaluates the closure inside step()"
            " where the scaler cannot unscale. Fix: use precision='bf16-mixed', or full precision (no plugin)."
        )
    if clip_val:
        for opt in raw:
            refuse_self_unscaling(owner, opt, clip_val)


def refuse_self_unscaling(owner: str, optimizer: Optimizer, clip_val: float) -> None:
    """Refuse clipping with an optimizer that unscales only inside ``step(grad_scaler=...)`` (torch's old API)."""
    if _compat.optimizer_takes_grad_scaler(optimizer):
        raise ValueError(
            f"{owner}('16-mixed'): clipping (gradient_clip_val={clip_val}) with {type(optimizer).__name__}, which"
            " unscales inside step(grad_scaler=...), would clip scaled gradients. Fix: use a torch optimizer with"
            " fused=True or no clipping."
        )


def has_grads(optimizer: Optimizer) -> bool:
    """Whether any parameter has a gradient (stops at the first one)."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def scaler_state_of(state_dict: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """``(saved precision, scaler state)`` of a plugin's saved state.

    Accepts ``AccelPrecision``'s (flat, or lit_accel 0.1's nested one), ``MixedPrecision``'s or a bare ``GradScaler``'s.
    """
    saved = state_dict.get("precision", "16-mixed" if "scale" in state_dict else None)
    nested = state_dict.get("scaler")
    return saved, nested if nested is not None else (state_dict if "scale" in state_dict else None)


def trainer_of(model: nn.Module) -> pl.Trainer | None:
    """The Trainer of the LightningModule inside a strategy's wrappers (DDP's ``module``), if it is attached to one."""
    for _ in range(8):  # bounded: wrappers nest a few levels at most
        if isinstance(model, LightningModule):
            try:
                return model.trainer
            except RuntimeError:  # "not attached to a Trainer"
                return None
        model = getattr(model, "module", None)
    return None
