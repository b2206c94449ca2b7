"""What ``AccelPrecision("fp8-mixed")`` does around torchao: convert at setup, report, revert at teardown."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_accel.plugins.float8 import Float8Conversion, ModuleFilter

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Float8Training"]


class Float8Training:
    """Converts the LightningModule's Linear layers when the strategy converts the module, reverts them at teardown.

    Args:
        owner, precision: the plugin's name and precision, for messages.
        float8: torchao's ``Float8LinearConfig`` or a ready ``Float8Conversion``; ``float8_filter``: which layers.

    Raises:
        ValueError: ``float8``/``float8_filter`` with another precision, or a filter besides a ready conversion.
    """

    def __init__(self, owner: str, precision: str, float8: Any, float8_filter: ModuleFilter | None) -> None:
        given = "float8" if float8 is not None else "float8_filter" if float8_filter is not None else None
        if precision != "fp8-mixed" and given:
            raise ValueError(
                f"{owner}({precision!r}, {given}=...): FP8 settings only apply to 'fp8-mixed'. Fix: pass"
                f" precision='fp8-mixed', or drop {given}."
            )
        if isinstance(float8, Float8Conversion) and float8_filter is not None:
            raise ValueError(
                f"{owner}('fp8-mixed', float8=Float8Conversion(...), float8_filter=...): the conversion has its own"
                " module_filter. Fix: pass Float8Conversion(config, module_filter=...) alone."
            )
        is_ready = isinstance(float8, Float8Conversion)
        self.conversion = float8 if is_ready else Float8Conversion(float8, module_filter=float8_filter)
        self._converted: nn.Module | None = None

    def convert(self, module: nn.Module, device: torch.device) -> nn.Module:
        if self._converted is not module:  # a strategy that converts twice (setup after a restart): done already
            self._converted = self.conversion.apply(module, device)
        return self._converted

    @staticmethod
    @contextmanager
    def eval_context() -> Generator[None, None, None]:
        """Evaluation under ``no_grad`` instead of inference mode (no graph, no saved tensors either way).

        Under inference mode, CPU autocast sends torchao's float8 tensors an ``aten.to.dtype``, which they do not
        implement.
        """
        if not torch.is_inference_mode_enabled():
            yield
            return
        with torch.inference_mode(False), torch.no_grad():
            yield

    def revert(self) -> None:
        """Put the original Linear objects back, unless sharding has taken the converted ones over."""
        module, self._converted = self._converted, None
        if module is None:
            return
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):
            # FSDP2 holds the converted layers (its parameters point at them): swapping them would detach it.
            rank_zero_info("AccelPrecision('fp8-mixed'): the sharded model keeps its Float8Linear layers after fit.")
            return
        self.conversion.revert(module)
