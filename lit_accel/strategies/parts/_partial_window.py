"""``PartialWindow``: the loaded batches of the current accumulation window, and the exact mean over a short one.

Lightning starts a window at ``batch_idx % k == 0`` and forces a step on an epoch's last batch, so only that window
can be shorter than ``k``; Lightning still divides each loss by ``k`` (issue #19987). With ``"mean"`` the gradient
of such a window is rescaled from ``1/k`` to ``1/m`` per loaded batch, right after the window's last backward and
before the precision plugin unscales, clips and steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from lit_accel.utilities._validation import check_choice
from lit_accel.utilities._workarounds import rescale_partial_window_

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["PartialWindow"]


class PartialWindow:
    """Counts the loaded batches since the last optimizer step (its only writer) and corrects a short window.

    Args:
        owner: the strategy's class name, for messages.
        mode: ``"mean"`` (a short window is averaged over the batches it had) or ``"lightning"`` (left as it is).
    """

    def __init__(self, owner: str, mode: Literal["mean", "lightning"] = "mean") -> None:
        check_choice(owner, "partial_window", mode, ("mean", "lightning"), "'mean'")
        self.mode = mode
        self._loaded = 0  # loaded batches since the last optimizer step

    def batch_started(self) -> None:
        """A loaded batch's ``training_step`` begins."""
        self._loaded += 1

    def new_fit(self) -> None:
        """A fit starts with an empty window."""
        self._loaded = 0

    def step(
        self, closure: Callable[[], Any], optimizer: Optimizer, accumulation: int, automatic: bool
    ) -> Callable[[], Any]:
        """The closure to step with (from the strategy's ``optimizer_step``): it ends the window when it runs."""
        correct = self.mode == "mean" and accumulation > 1 and automatic

        def window_closure() -> Any:
            # Runs the window's final batch (its training_step counted, its gradient sync included), then - before
            # the precision plugin unscales, clips and steps - rescales a short window from 1/k to 1/m.
            output = closure()
            loaded, self._loaded = self._loaded, 0
            if correct:
                params = (p for group in optimizer.param_groups for p in group["params"])
                rescale_partial_window_(params, accumulation, loaded)
            return output

        return window_closure
