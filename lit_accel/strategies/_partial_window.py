"""``PartialWindow``: the exact mean over an epoch's short last accumulation window.

Lightning starts a window at ``batch_idx % k == 0`` and forces a step on an epoch's last batch, so only that window
can be shorter than ``k``; Lightning still divides each loss by ``k`` (issue #19987). With ``"mean"`` the gradient
of such a window is rescaled from ``1/k`` to ``1/m`` per loaded batch, right after the window's last backward and
before the precision plugin unscales, clips and steps. ``m`` is read from Lightning's batch index when the window
ends (``batch_idx % k + 1``: the windows restart with each epoch and line up after a resume), so nothing is counted
per batch and a step that cannot be short (``k = 1``, manual optimization, ``"lightning"``) runs Lightning's closure
as it is.
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
    """Averages an epoch's short last accumulation window over the loaded batches it had.

    Args:
        owner: the strategy's class name, for messages.
        mode: ``"mean"`` (a short window is averaged over the batches it had) or ``"lightning"`` (left as it is).
    """

    def __init__(self, owner: str, mode: Literal["mean", "lightning"] = "mean") -> None:
        check_choice(owner, "partial_window", mode, ("mean", "lightning"), "'mean'")
        self.mode = mode

    def step(
        self,
        closure: Callable[[], Any],
        optimizer: Optimizer,
        accumulation: int,
        automatic: bool,
        batch_idx: Callable[[], int],
    ) -> Callable[[], Any]:
        """The closure to step with (from the strategy's ``optimizer_step``); ``batch_idx``: the epoch's batch index."""
        if self.mode != "mean" or accumulation == 1 or not automatic:
            return closure  # no window to correct: Lightning's own closure, no frame of ours

        def window_closure() -> Any:
            # Runs the window's final batch (its gradient sync included), then - before the precision plugin
            # unscales, clips and steps - rescales a short window from 1/k to 1/m.
            output = closure()
            params = (p for group in optimizer.param_groups for p in group["params"])
            rescale_partial_window_(params, accumulation, batch_idx() % accumulation + 1)
            return output

        return window_closure
