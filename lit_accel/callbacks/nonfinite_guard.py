"""``NonFiniteGuard``: keep inf/NaN gradients out of the weights under bf16 or fp32, with any precision plugin."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lit_accel.utilities import _compat, _workarounds
from lit_accel.utilities._idle_hooks import idle, idle_unused, wake
from lit_accel.utilities._lagged_flags import LaggedFlags
from lit_accel.utilities._validation import check_choice

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard(Callback):
    """Check the gradients before every optimizer step; a step with inf/NaN gradients never reaches the weights.

    bf16 and fp32 have no loss scaler to skip such a step, so an inf/NaN gradient would be written into the weights
    and the optimizer state. The guard takes one norm over the gradients before each step, then:

    * ``action="raise"`` (default): the step is skipped and the fit stops, naming the optimizer step and batch index;
    * ``action="skip"``: the step is skipped (weights and optimizer state untouched), counted in ``skipped_steps``,
      and step-interval LR schedulers do not move.

    It works with any precision plugin, Lightning's own included, and stands aside (saying so once) when the plugin
    scales the loss: the fp16 scaler already skips such steps. Under DDP every rank sees the same all-reduced
    gradients, and sharded (FSDP2) gradients are reduced across ranks, so all ranks skip or stop at the same step.

    Host syncs per step: one with ordinary optimizers (it decides whether the step runs); none with fused ones
    (``fused=True``), whose kernel takes the flag and skips on the device; ``"raise"`` then reads it from a host copy
    two steps later (or at the end of fit), the same step on every rank. ``docs/precision.md`` has the details.

    Args:
        action: ``"raise"`` or ``"skip"``.

    Raises:
        ValueError: an unknown ``action``.
        RuntimeError: while fitting, non-finite gradients with ``action="raise"``.

    Example::

        trainer = Trainer(precision="bf16-mixed", callbacks=[NonFiniteGuard(action="skip")])
    """

    def __init__(self, action: Literal["raise", "skip"] = "raise") -> None:
        check_choice(type(self).__name__, "action", action, ("raise", "skip"), "'raise'")
        self.action = action
        #: Whether the guard checks this fit's steps (False while the precision plugin scales the loss).
        self.active = True
        #: The record of each optimizer's last step (by id): skipped or not, a 0-d device flag for fused optimizers.
        self._skipped: dict[int, bool | Tensor] = {}
        self._count: Tensor | int = 0  # skipped steps; a device tensor once a fused step was counted
        self._lagged = LaggedFlags(lag=1)  # fused + "raise": (flag, (step, batch_idx)), read a step later
        idle_unused(self)  # one per-step hook: Lightning's dispatch skips the others

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients (``action="skip"``). Syncs."""
        return int(self._count)

    def step_was_skipped(self, optimizer: Optimizer | None = None) -> bool:
        """Whether the last step of ``optimizer`` (any, for ``None``) was skipped; a fused one's flag costs a sync."""
        flags = self._skipped.values() if optimizer is None else [self._skipped.get(id(optimizer), False)]
        return any(bool(flag) for flag in flags)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.active = not (isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled())
        self._skipped, self._lagged = {}, LaggedFlags(lag=1)
        wake(self, "on_before_optimizer_step")
        if not self.active:
            idle(self, NonFiniteGuard, "on_before_optimizer_step")  # standing aside: no hook call per step
            rank_zero_info(f"NonFiniteGuard: precision {trainer.precision!r} scales the loss, and its scaler already"
                           " skips steps with inf/NaN gradients; the guard stands aside.")  # fmt: skip
        elif self.action == "skip":
            configs = trainer.lr_scheduler_configs
            trainer.strategy.lr_scheduler_configs = _workarounds.skip_aware_schedulers(configs, self)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self.active:
            return
        self._raise_due(wait=False)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            self._skipped[id(optimizer)] = False
            return
        total = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)  # inf/NaN anywhere -> inf/NaN, no overflow
        full_tensor = getattr(total, "full_tensor", None)  # a DTensor (FSDP2): the norm over every rank's shards
        total = full_tensor() if callable(full_tensor) else total
        if _compat.optimizer_handles_amp_scaling(optimizer):
            self._fused(trainer, optimizer, ~torch.isfinite(total))
        elif not math.isfinite(total.item()):  # the documented sync: whether the step may run
            self._skip(trainer, optimizer)
        else:
            self._skipped[id(optimizer)] = False

    def _fused(self, trainer: pl.Trainer, optimizer: Optimizer, bad: Tensor) -> None:
        """The fused kernel skips the step on the device when ``found_inf`` is set: no sync here."""
        _set_found_inf(optimizer, bad.to(torch.float32))
        self._skipped[id(optimizer)] = bad
        if self.action == "raise":
            self._lagged.push(bad, tag=_where(trainer))
        else:
            self._count = bad.to(torch.int64) + self._count

    def _skip(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        if self.action == "raise":
            raise RuntimeError(_message(_where(trainer)))
        for group in optimizer.param_groups:  # optimizers leave parameters without a gradient (and their state) alone
            for param in group["params"]:
                param.grad = None
        self._skipped[id(optimizer)] = True
        self._count = self._count + 1

    def _raise_due(self, wait: bool) -> None:
        at = self._lagged.first_set(wait=wait)
        if at is not None:
            self._lagged.clear()
            raise RuntimeError(_message(at))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Clear the fused optimizers' flags; raise for a bad step of the last two that had not been read yet."""
        self._release(trainer)
        if self.active:
            self._raise_due(wait=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(trainer)

    def _release(self, trainer: pl.Trainer) -> None:
        for optimizer in trainer.optimizers:
            _set_found_inf(optimizer, None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._count = int(state_dict.get("skipped_steps", 0))


def _set_found_inf(optimizer: Optimizer, found_inf: Tensor | None) -> None:
    """Hand a fused optimizer the flag its kernel skips the step on (``None``: take it back).

    ``GradScaler.step``'s contract with ``_step_supports_amp_scaling`` optimizers: torch's fused Adam/AdamW/SGD/Adagrad
    read ``found_inf`` with ``getattr`` after running the closure.
    """
    if found_inf is not None:
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    elif hasattr(optimizer, "found_inf"):
        del optimizer.found_inf  # type: ignore[attr-defined]


def _where(trainer: pl.Trainer) -> tuple[int, int]:
    return trainer.global_step, _compat.train_batch_idx(trainer)


def _message(at: tuple[int, int]) -> str:
    return (
        f"NonFiniteGuard: non-finite gradients (inf/NaN) at optimizer step {at[0]} (batch_idx {at[1]}); the step was"
        " skipped, the weights are finite. Fix: lower the learning rate or add warm-up/clipping, check this batch for"
        " inf/NaN, or pass NonFiniteGuard(action='skip')."
    )
