"""``PipelineLoss``: a LightningModule that declares its loss once runs the same under every strategy.

Under a pipeline the last stage computes the loss of each micro-batch from the last unit's output, so the loss must be
a function of ``(output, target)`` rather than of a whole ``training_step``. With this mixin a module defines
``forward`` and ``pipeline_loss`` once; its ``training_step`` and ``validation_step`` are derived from them for one
process, DDP, FSDP and AccelParallel without a pipeline, and AccelParallel calls ``pipeline_loss`` itself with one.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["PipelineLoss"]


class PipelineLoss:
    """Mixin for a ``LightningModule``: ``training_step``/``validation_step`` from ``pipeline_loss``.

    Override ``pipeline_loss(output, target)`` (the mean loss over a micro-batch's samples) and, when a batch is not
    an ``(inputs, target)`` pair, ``pipeline_batch(batch)``. ``validation_step`` logs ``val_loss``, as AccelParallel
    does under a pipeline.

    Example::

        class GPT(PipelineLoss, LightningModule):
            def forward(self, tokens): ...
            def pipeline_loss(self, logits, targets):
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    """

    def pipeline_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a loaded batch (default: the batch is that pair)."""
        inputs, target = batch
        return inputs, target

    def pipeline_loss(self, output: Any, target: Any) -> Tensor:
        """The mean loss over the samples of ``output`` (the last unit's output) against ``target``."""
        raise NotImplementedError(f"{type(self).__name__} must define pipeline_loss(output, target).")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss of ``batch`` (one process, or a strategy without a pipeline)."""
        inputs, target = self.pipeline_batch(batch)
        return self.pipeline_loss(self(*_args(inputs)), target)  # type: ignore[operator]

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss of ``batch``, logged as ``val_loss``."""
        inputs, target = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self(*_args(inputs)), target)  # type: ignore[operator]
        self.log("val_loss", loss, sync_dist=True)  # type: ignore[attr-defined]
        return loss


def _args(inputs: Any) -> tuple[Any, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)
