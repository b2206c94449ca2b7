"""``MicroBatching``: each loaded batch split into micro-batches, and (``"auto"``) the largest that fits in memory.

The global batch fixes what an optimizer step sees, so the micro-batch is free to change without changing the
training: a loaded batch of ``n`` samples runs as chunks of ``size`` along dim 0, each loss weighted by its share of
the ``n`` samples, gradients kept local on every chunk but the last (whose backward Lightning runs, synchronised).

``"auto"`` starts with the whole loaded batch and halves on an out-of-memory error (CUDA ``OutOfMemoryError``, the CPU
allocator's failure). An attempt that failed anywhere is discarded on every rank (gradients dropped) and redone with
half the size: no sample is lost or counted twice, and no rank is ever left waiting in a collective:

- AccelDDP (no collective in forward): while a size is unproven (the first step, and the step after each change)
  every chunk's backward stays local, the ranks agree on the outcome with one all-reduce, and only then are the
  gradients averaged (one explicit all-reduce). Once proven, the last chunk's backward reduces as usual, after one
  agree all-reduce that follows its forward.
- AccelFSDP (all-gathers in forward, reduce-scatters in backward): the attempt runs every backward itself, the last
  chunk's reduce-scattering, and its collectives are kept in step by a ``CollectiveLedger``
  (``strategies/_fsdp_recovery.py``); the ranks agree after the backward.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "MicroBatchChange",
    "MicroBatching",
    "PeerOutOfMemory",
    "all_reduce_mean_",
    "any_rank",
    "is_out_of_memory",
    "split_batch",
]

_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: one flat copy of at most this much at a time


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, the CPU allocator's "can't allocate memory", or a ``MemoryError`` (bad_alloc)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this attempt (raised on the others at the same collective)."""


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one 1-element all-reduce and one host read."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def batch_length(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its tensors, which must agree."""
    sizes = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            sizes.add(value.shape[0] if value.dim() else None)
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(batch)
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"micro-batching needs tensors with one dim-0 size in the batch, got sizes {sorted(sizes)}")
    return sizes.pop()


def split_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of every tensor of ``batch`` (tensors, tuples, lists, dicts); other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: split_batch(v, start, stop) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(split_batch(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(split_batch(v, start, stop) for v in batch)
    return batch


@dataclass(frozen=True)
class MicroBatchChange:
    """The micro-batch size changed at an optimizer step (``step`` counts steps attempted so far)."""

    step: int
    old: int
    new: int


class MicroBatching:
    """Run a loaded batch as micro-batches of ``size`` (an int), or find and keep the largest that fits (``"auto"``).

    Args:
        owner: the strategy's class name, for messages.
        size: an int (fixed) or ``"auto"``.
    """

    def __init__(self, owner: str, size: int | str) -> None:
        self.owner = owner
        self.auto = size == "auto"
        self.size: int | None = None if self.auto else int(size)  # type: ignore[arg-type]
        #: Every change of the size, in order.
        self.changes: list[MicroBatchChange] = []
        self._proven = not self.auto
        self._held: list[tuple[Tensor, Tensor]] = []
        self._statistics: _Statistics | None = None

    def new_fit(self) -> None:
        """A further fit (maybe of another model) keeps the size found, and forgets the model's BatchNorm layers."""
        self._statistics = None

    def run(self, strategy: Any, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict) -> Any:
        """``strategy.training_step`` for one loaded batch: every forward and backward but AccelDDP's last backward."""
        n = batch_length(batch)
        if self.size is None:
            self.size = n  # "auto" starts with the whole loaded batch
        accumulation = strategy._attached_trainer.accumulate_grad_batches
        # Lightning zeroes the gradients between a window's first training_step and its backward, so the chunks'
        # backward starts from none and their gradients are held over that zero_grad (``restore_gradients``); the
        # earlier ones go back for Lightning to zero or keep, as it would without micro-batches.
        earlier = _take_gradients(strategy.model)
        ledger = strategy._collective_ledger() if self.auto else None
        if self.auto:
            if self._statistics is None:
                self._statistics = _Statistics(strategy.lightning_module)
            self._statistics.save()  # a discarded attempt's forward must not move the running statistics
        while True:
            size = min(self.size, n)
            bounds = [(i, min(i + size, n)) for i in range(0, n, size)]
            proven = self._proven
            lightning_last = proven and ledger is None  # else every backward runs here
            if ledger is not None:
                ledger.begin(len(bounds), strategy.root_device)
            failure = None  # "own" (this rank ran out of memory) or "peer" (another did; FSDP's guarded attempts)
            try:
                output = self._attempt(
                    strategy, step, batch, bounds, n, accumulation, lightning_last, ledger is not None, args, kwargs
                )
            except Exception as err:
                failure = "peer" if isinstance(err, PeerOutOfMemory) else "own" if is_out_of_memory(err) else None
                if not self.auto or failure is None:
                    if ledger is not None:
                        ledger.finish(succeeded=False)
                    _put_gradients(earlier)
                    raise
                output = None
            if self.auto:
                if ledger is not None and failure is not None:
                    gc.collect()  # the failed attempt's activations, held by the exception's frames until now
                    ledger.reset()
                    if failure == "own":
                        ledger.complete_for_peers()
                failed = failure == "peer" or any_rank(failure is not None, strategy.root_device)
                if ledger is not None:
                    ledger.finish(succeeded=not failed)
                if failed:
                    assert self._statistics is not None
                    self._statistics.restore()
                    self._shrink(strategy)
                    continue
            if not lightning_last and self.auto:
                if ledger is None:
                    self._average(strategy)
                self._proven = True
                output = _replace_loss(output, _loss_of(output).detach().requires_grad_())  # Lightning's: no-op
            elif self.auto:
                strategy._prepare_backward_sync(output)  # every rank got here: the last backward may reduce
            self._held = _take_gradients(strategy.model)
            _put_gradients(earlier)
            return output

    def _average(self, strategy: Any) -> None:
        try:
            strategy._average_gradients()  # the backward of every chunk stayed local
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            raise RuntimeError(
                f"{type(strategy).__name__}(micro_batch_size='auto'): out of memory averaging the gradients (one"
                f" bucket of at most {_BUCKET_BYTES // 2**20} MB at a time), which no micro-batch size changes. Fix:"
                " more memory per device, or AccelFSDP, which shards the gradients."
            ) from err

    def restore_gradients(self) -> None:
        """Add back the micro-batches' gradients held over Lightning's ``zero_grad`` (a no-op when none are held)."""
        _put_gradients(self._held)
        self._held = []

    def _attempt(
        self, strategy: Any, step: Callable[..., Any], batch: Any, bounds: list, n: int, accumulation: int,
        lightning_last: bool, reduce_last: bool, args: tuple, kwargs: dict,
    ) -> Any:  # fmt: skip
        last = len(bounds) - 1
        total = None
        for i, (start, stop) in enumerate(bounds):
            weight = (stop - start) / n
            if i == last and lightning_last:  # Lightning runs this chunk's backward, synchronised
                if self.auto:  # a forward free of collectives, so a failure is agreed on first (prepared in run)
                    with strategy.block_backward_sync():
                        output = step(split_batch(batch, start, stop), *args, **kwargs)
                else:
                    output = step(split_batch(batch, start, stop), *args, **kwargs)
                loss = _loss_of(output)
                # the gradient of the last chunk's share; the value (for logging) of the whole loaded batch
                return _replace_loss(output, loss * weight if total is None else loss * weight + total)
            # AccelFSDP's "auto": the last chunk reduce-scatters here, even inside Lightning's accumulation window, so
            # that a failed attempt leaves no partial gradient inside FSDP (earlier loaded batches' are sharded).
            with strategy._reduce_in_attempt() if i == last and reduce_last else strategy.block_backward_sync():
                output = step(split_batch(batch, start, stop), *args, **kwargs)
                loss = _loss_of(output)
                # Lightning divides the loss it backpropagates by the accumulation: these chunks get the same.
                strategy.backward(loss * (weight / accumulation), None)
            total = loss.detach() * weight if total is None else total + loss.detach() * weight
            if i < last:
                del output, loss
        return _replace_loss(output, total)

    def _shrink(self, strategy: Any) -> None:
        strategy._discard_gradients()
        gc.collect()
        if strategy.root_device.type == "cuda":
            torch.cuda.empty_cache()
        assert self.size is not None
        old = self.size
        if old <= 1:
            raise RuntimeError(
                f"{self.owner}(micro_batch_size='auto'): a single sample per micro-batch does not fit in memory. Fix:"
                " a smaller model or input, activation checkpointing or sharding (AccelFSDP), or more memory."
            )
        self.size = (old + 1) // 2
        step = strategy._attached_trainer.global_step
        self.changes.append(MicroBatchChange(step, old, self.size))
        self._proven = False
        rank_zero_info(f"{self.owner}: out of memory at optimizer step {step}; micro-batch {old} -> {self.size}.")


class _Statistics:
    """The running statistics of a model's BatchNorm layers, saved before each loaded batch (one foreach copy)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from torch.nn.modules.batchnorm import _BatchNorm

        names = ("running_mean", "running_var", "num_batches_tracked")
        layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        self.buffers = [b for m in layers for b in (getattr(m, n) for n in names) if isinstance(b, torch.Tensor)]
        self.saved = [b.detach().clone() for b in self.buffers]

    def save(self) -> None:
        if self.buffers:
            torch._foreach_copy_(self.saved, self.buffers)

    def restore(self) -> None:
        if self.buffers:
            torch._foreach_copy_(self.buffers, self.saved)


def all_reduce_mean_(grads: list[Tensor], group: Any = None) -> None:
    """Average ``grads`` over the ranks of ``group`` in place: one all-reduce per bucket of one dtype."""
    world = dist.get_world_size(group)
    buckets: list[list[Tensor]] = []
    for grad in grads:
        last = buckets[-1] if buckets else None
        fits = last is not None and last[0].dtype == grad.dtype
        if not fits or sum(g.numel() * g.element_size() for g in last) >= _BUCKET_BYTES:  # type: ignore[union-attr]
            buckets.append([grad])
        else:
            last.append(grad)  # type: ignore[union-attr]
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(part.view_as(grad))


def _take_gradients(model: torch.nn.Module) -> list[tuple[Tensor, Tensor]]:
    taken = [(p, p.grad) for p in model.parameters() if p.grad is not None]
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
