"""``MicroBatching``: each loaded batch run as micro-batches of the plan's size; ``"auto"`` finds that size first.

The global batch fixes what an optimizer step sees, so the micro-batch is free to change without changing the
training: a loaded batch of ``n`` samples runs as chunks of ``size`` along dim 0, each loss weighted by its share of
the ``n`` samples, gradients kept local on every chunk but the last (whose backward Lightning runs, synchronised).
``"auto"`` chooses the size on the first loaded batch of a fit (``_micro_batch_search``), before the first optimizer
step, keeping only a size that has run; an out-of-memory error later ends the job with a message naming the next
smaller size (in a trial of the search: the largest size that ran).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from lit_accel.strategies.parts import _micro_batch_search as search
from lit_accel.strategies.parts._micro_batch_trials import SearchLog, is_out_of_memory
from lit_accel.utilities._batches import batch_length, split_batch
from lit_accel.utilities._memory import PeakMemory, available_bytes, optimizer_state_bytes

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["LocalAttemptHost", "MicroBatchHost", "MicroBatching"]


@runtime_checkable
class MicroBatchHost(Protocol):
    """What micro-batching needs from a strategy: Lightning's public members and two of lit_accel's."""

    @property
    def model(self) -> torch.nn.Module | None: ...

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    def block_backward_sync(self) -> AbstractContextManager[None]:
        """Gradients kept local in the backward run inside (Lightning's accumulation context)."""

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward through the precision plugin."""

    def gradient_sync(self) -> AbstractContextManager[None]:
        """Gradients reduced in the backward run inside, even within Lightning's accumulation window."""

    def forward_collective(self) -> str | None:
        """What makes a collective in the model's forward (``"auto"`` then measures instead of attempting), or None."""


@runtime_checkable
class LocalAttemptHost(Protocol):
    """A strategy whose forward makes collectives that it can switch off for ``"auto"``'s attempts (AccelFSDP)."""

    def without_collectives(self) -> AbstractContextManager[Callable[[], None]] | None:
        """A block without collectives, giving a ``reset`` to call after each attempt; None where there is none."""


class MicroBatching:
    """Run each loaded batch as micro-batches of ``size`` (an int), or of the size ``"auto"`` finds at the first one.

    Args:
        owner: the strategy's class name, for messages.
        size: an int, or ``"auto"``.
        chosen: called with the size ``"auto"`` chose (the same on every rank) and the search's report, once per fit.
        local_ranks: processes on this node, which share its host memory.
    """

    def __init__(
        self, owner: str, size: int | str, chosen: Callable[[int, str | None], Any] | None = None, local_ranks: int = 1
    ) -> None:
        self.owner = owner
        self.auto = size == "auto"
        #: The micro-batch in use (``None`` until ``"auto"`` chose it).
        self.size: int | None = None if self.auto else int(size)
        self._chosen, self._local_ranks = chosen, local_ranks
        self._held: list[tuple[Tensor, Tensor]] = []
        self._trying: int | None = None  # the size the search is running
        #: What ``"auto"``'s search tried and kept (``None`` for a fixed size).
        self.search_log: SearchLog | None = None

    def run(
        self, host: MicroBatchHost, step: Callable[..., Any], accumulation: int, batch: Any, *args: Any, **kw: Any
    ) -> Any:
        """``training_step`` for one loaded batch: every forward and backward but the last chunk's backward."""
        n = batch_length(batch)
        # Lightning zeroes the gradients between a window's first training_step and its backward, so the chunks'
        # backward starts from none and their gradients are held over that zero_grad (``restore_gradients``); the
        # earlier ones go back for Lightning to zero or keep, as it would without micro-batches.
        earlier = _take_gradients(host)
        try:
            if self.size is None:
                self.size = self._search(host, step, batch, n, args, kw)
                if self._chosen is not None:
                    self._chosen(self.size, None if self.search_log is None else self.search_log.describe())
            output = self._split(host, step, batch, n, accumulation, args, kw)
        except Exception as err:
            _put_gradients(earlier)
            if is_out_of_memory(err) and self.size is not None:
                raise RuntimeError(out_of_memory_message(self.owner, self.size)) from err
            if is_out_of_memory(err) and self._trying is not None:  # a trial with collectives
                fits = None if self.search_log is None else self.search_log.largest_fitting(below=self._trying)
                raise RuntimeError(out_of_memory_message(self.owner, self._trying, fits, trial=True)) from err
            raise
        self._held = _take_gradients(host)
        _put_gradients(earlier)
        return output

    def restore_gradients(self) -> None:
        """Add back the micro-batches' gradients held over Lightning's ``zero_grad`` (a no-op when none are held)."""
        _put_gradients(self._held)
        self._held = []

    def _split(
        self, host: MicroBatchHost, step: Callable[..., Any], batch: Any, n: int, accumulation: int, args: tuple,
        kwargs: dict,
    ) -> Any:  # fmt: skip
        assert self.size is not None
        bounds = [(i, min(i + self.size, n)) for i in range(0, n, self.size)]
        total = None
        for start, stop in bounds[:-1]:
            weight = (stop - start) / n
            with host.block_backward_sync():
                output = step(split_batch(batch, start, stop), *args, **kwargs)
                loss = _loss_of(output)
                # Lightning divides the loss it backpropagates by the accumulation: these chunks get the same.
                host.backward(loss * (weight / accumulation), None)
            total = loss.detach() * weight if total is None else total + loss.detach() * weight
            del output, loss
        start, stop = bounds[-1]
        output = step(split_batch(batch, start, stop), *args, **kwargs)  # Lightning runs this chunk's backward
        loss, weight = _loss_of(output), (stop - start) / n
        # the gradient of the last chunk's share; the value (for logging) of the whole loaded batch
        return _replace_loss(output, loss * weight if total is None else loss * weight + total)

    def _search(
        self, host: MicroBatchHost, step: Callable[..., Any], batch: Any, n: int, args: tuple, kwargs: dict
    ) -> int:  # fmt: skip
        module, device = host.lightning_module, host.root_device
        assert module is not None
        statistics = _Statistics(module)  # the attempts' and probes' forwards must not move running statistics

        def run(size: int, synced: bool = False, limit: int | None = None) -> None:
            self._trying = size
            bounds = [(start, min(start + size, n)) for start in range(0, n, size)][:limit]
            for i, (start, stop) in enumerate(bounds):
                last = synced and i == len(bounds) - 1  # reduces, as Lightning's backward of it will
                with host.gradient_sync() if last else host.block_backward_sync():
                    output = step(split_batch(batch, start, stop), *args, **kwargs)
                    host.backward(_loss_of(output) * ((stop - start) / n), None)
                del output

        def cleanup() -> None:
            _drop_gradients(host)
            statistics.restore()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        smallest = 2 if statistics.buffers else 1  # BatchNorm needs two samples
        return self._choose(host, run, cleanup, n, smallest)

    def _choose(
        self, host: MicroBatchHost, run: Callable[..., None], cleanup: Callable[[], None], n: int, smallest: int
    ) -> int:  # fmt: skip
        """The search that fits the host: attempts (without collectives, or with everything gathered), or trials."""
        device = host.root_device
        reserve = optimizer_state_bytes(host.optimizers)  # allocated by the first step, held from then on
        collective = host.forward_collective()
        log = self.search_log = SearchLog()
        # the gradients at full size (a DTensor's numel is the global one): what accumulating micro-batches hold
        grads = sum(p.numel() * p.element_size() for p in _parameters(host) if p.requires_grad)
        if collective is None:  # attempts without any collective: an out-of-memory error is caught safely
            # They skip the synchronised backward, which stages the gradients (DDP also rebuilds its buckets at the
            # second step): room for one more copy of them.
            return search.by_attempts(run, cleanup, n, device, self.owner, log, self._local_ranks, reserve + grads,
                                      grads, smallest)  # fmt: skip
        if available_bytes(device, self._local_ranks) is None or not PeakMemory.supported(device):
            raise ValueError(
                f"{self.owner}(micro_batch_size='auto') must measure memory here ({collective} makes collectives in"
                f" forward), which it cannot do on {device}. Fix: pass an int micro_batch_size."
            )
        synced, ranks = functools.partial(run, synced=True), self._local_ranks
        local = host.without_collectives() if isinstance(host, LocalAttemptHost) else None
        # attempts with every parameter gathered: room for them (at most the gradients' size), the attempt's
        # gradients, the reserve and the staging copy
        if local is not None and search.room_for(reserve + 3 * grads, device, ranks):
            return search.by_gathered_attempts(run, synced, cleanup, local, n, device, self.owner, log, ranks,
                                               reserve, grads, smallest)  # fmt: skip
        return search.by_measurement(synced, cleanup, n, device, self.owner, log, ranks, reserve, grads, smallest)


def out_of_memory_message(owner: str, size: int, fits: int | None = None, trial: bool = False) -> str:
    """The one message of an out-of-memory error with micro-batches of ``size``: in training, or in ``"auto"``'s trial.

    ``fits``: a size known to have run (the search's), named as the fix instead of half of ``size``.
    """
    smaller = fits if fits is not None else (size + 1) // 2
    fix = f"micro_batch_size={smaller}" if size > 1 else "a smaller model or input, or more memory per device"
    if trial and fits is None:  # the search's first trial: nothing is known to fit
        fix = "a smaller model or input, activation checkpointing, or more memory per device (no micro-batch ran)"
    where = " while micro_batch_size='auto' tried it" if trial else ""
    ran = " (the largest that ran)" if fits is not None else ""
    return f"{owner}: out of memory in a micro-batch of {size} samples{where}. Fix: {fix}{ran}."


class _Statistics:
    """The running statistics of a model's BatchNorm layers, saved at construction, restored on demand."""

    def __init__(self, module: torch.nn.Module) -> None:
        from torch.nn.modules.batchnorm import _BatchNorm

        names = ("running_mean", "running_var", "num_batches_tracked")
        layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        self.buffers = [b for m in layers for b in (getattr(m, n) for n in names) if isinstance(b, torch.Tensor)]
        self.saved = [b.detach().clone() for b in self.buffers]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.saved):
                buffer.copy_(saved)


def _parameters(host: MicroBatchHost) -> list[torch.nn.Parameter]:
    return [] if host.model is None else list(host.model.parameters())


def _drop_gradients(host: MicroBatchHost) -> None:
    for param in _parameters(host):
        param.grad = None


def _take_gradients(host: MicroBatchHost) -> list[tuple[Tensor, Tensor]]:
    taken = [(p, p.grad) for p in _parameters(host) if p.grad is not None]
    for param, _ in taken:
        param.grad = None
    return taken  # type: ignore[return-value]


def _put_gradients(taken: list[tuple[Tensor, Tensor]]) -> None:
    for param, grad in taken:
        param.grad = grad if param.grad is None else param.grad.add_(grad)


def _loss_of(output: Any) -> Tensor:
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError("micro-batching needs training_step to return the loss (a tensor, or a dict with 'loss').")
    return loss


def _replace_loss(output: Any, loss: Tensor) -> Any:
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss
