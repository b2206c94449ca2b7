"""How :class:`~lit_accel.meters.MemoryMeter` sizes tensors: metadata only (``numel x element_size``), never a value.

``size_tensors`` books each tensor's local bytes by dtype and its unsharded size: an FSDP2 ``DTensor`` reports its
global shape, ``to_local()`` gives the shard this rank holds. :class:`SavedTensorProbe` measures the activation memory
of one forward: the unique storages autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``;
sizes and weak references only, so it keeps none of them alive),
without the parameters (nor the tensors sharing a parameter's storage, such as its transpose or FSDP2's unsharded
copy) and with autocast's per-op parameter casts counted apart. Tensors that activation checkpointing keeps for its
recomputation (each region's inputs) are saved through the same hooks, so they count; the recomputed ones do not.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lit_accel.meters._memory_metrics import DtypeBytes

__all__ = ["SavedTensorProbe", "Sized", "dtype_slot", "size_tensors", "state_tensors"]

_SLOTS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# View and cast chains between a saved tensor and its parameter are short (a cast, then a transpose or reshape).
_MAX_CHAIN = 4
_Kind = Literal["activation", "param", "cast"]


def dtype_slot(dtype: torch.dtype) -> str:
    """The :data:`~lit_accel.meters._memory_metrics.DTYPE_SLOTS` entry of ``dtype``."""
    if dtype in _SLOTS:
        return _SLOTS[dtype]
    return "fp8" if "float8" in str(dtype) else "other"


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


_DTENSOR = _dtensor_type()


def _local(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t``."""
    if _DTENSOR is not None and isinstance(t, _DTENSOR):
        with torch.no_grad():  # to_local() is differentiable: no autograd node for a size
            return t.to_local()
    return t


@dataclass
class Sized:
    """Local bytes by dtype, and the bytes the same tensors take unsharded."""

    local: DtypeBytes = field(default_factory=DtypeBytes)
    unsharded: float = 0.0

    def __iadd__(self, other: Sized) -> Sized:
        for slot, nbytes in other.local.nonzero().items():
            self.local.add(slot, nbytes)
        self.unsharded += other.unsharded
        return self


def size_tensors(tensors: Iterable[Tensor]) -> Sized:
    """Sizes of ``tensors`` (each counted as given: deduplicate before, as ``Module.parameters()`` does)."""
    out = Sized()
    for t in tensors:
        local = _local(t)
        out.local.add(dtype_slot(t.dtype), local.numel() * local.element_size())
        out.unsharded += t.numel() * t.element_size()  # a DTensor's numel is its global one
    return out


def state_tensors(state: Any) -> Iterator[Tensor]:
    """Every tensor in an optimizer's per-parameter state (values, and tensors inside lists, tuples or dicts)."""
    if isinstance(state, Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from state_tensors(value)


class SavedTensorProbe:
    """While active, book every storage autograd saves for the backward as activation, parameter or cast.

    Args:
        parameters: the model's parameters (their storages, and those of their local shards, are excluded).
    """

    def __init__(self, parameters: Iterable[Tensor]) -> None:
        # Storage objects keep one Python identity per storage while alive (PyTorch preserves the PyObject). The
        # probe holds none: a weak reference tells a storage seen before from a new one that took a freed one's id
        # (a pipeline's backward frees a micro-batch's activations while the next ones are saved).
        self._params = {id(s): s for s in (_local(p).untyped_storage() for p in parameters)}
        self._seen: dict[int, tuple[weakref.ref, float, str, _Kind]] = {}
        self._bytes: dict[tuple[_Kind, str], float] = {}  # every storage counted, alive or not
        self._hooks: Any = None

    @property
    def active(self) -> bool:
        """Between :meth:`start` and :meth:`stop`."""
        return self._hooks is not None

    def start(self) -> None:
        """Install the hooks (this thread; the forward runs in it)."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def stop(self) -> tuple[DtypeBytes, float]:
        """Remove the hooks; return the activation bytes by dtype and the bytes of parameter casts."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        activations, casts = DtypeBytes(), 0.0
        for (kind, slot), nbytes in self._bytes.items():
            if kind == "activation":
                activations.add(slot, nbytes)
            elif kind == "cast":
                casts += nbytes
        self._seen.clear()
        self._bytes.clear()
        return activations, casts

    def _pack(self, tensor: Tensor) -> Tensor:
        local = _local(tensor)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage of its own: its own size
            self._count(tensor, float(local.numel() * local.element_size()), dtype_slot(local.dtype), "activation")
            return tensor
        self._count(storage, float(storage.nbytes()), dtype_slot(local.dtype), self._kind(tensor, storage))
        return tensor

    def _count(self, owner: Any, nbytes: float, slot: str, kind: _Kind) -> None:
        """Count ``owner`` (a storage) once while it lives; a parameter or a cast wins over an activation."""
        previous = self._seen.get(id(owner))
        if previous is not None and previous[0]() is owner:
            if previous[3] != "activation" or kind == "activation":
                return
            self._add(previous[3], previous[2], -previous[1])  # seen as an activation first: booked again below
        self._seen[id(owner)] = (weakref.ref(owner), nbytes, slot, kind)
        self._add(kind, slot, nbytes)

    def _add(self, kind: _Kind, slot: str, nbytes: float) -> None:
        self._bytes[kind, slot] = self._bytes.get((kind, slot), 0.0) + nbytes

    def _kind(self, tensor: Tensor, storage: Any) -> _Kind:
        """A parameter (or a view of one), a whole-parameter cast of one, or an activation."""
        if id(storage) in self._params or isinstance(tensor, nn.Parameter):
            return "param"
        node, cast = tensor.grad_fn, False
        for _ in range(_MAX_CHAIN):
            if node is None:
                return "activation"
            leaf = getattr(node, "variable", None)  # AccumulateGrad: the chain reached a leaf
            if leaf is not None:
                return _leaf_kind(tensor, storage, leaf, cast)
            inputs = [n for n, _ in node.next_functions if n is not None]
            if len(inputs) != 1:
                return "activation"
            cast = cast or node.name().startswith("ToCopyBackward")
            node = inputs[0]
        return "activation"


def _leaf_kind(tensor: Tensor, storage: Any, leaf: Tensor, cast: bool) -> _Kind:
    """What a saved tensor whose autograd chain reaches ``leaf`` is."""
    # FSDP2's unsharded parameter, through a transpose or view (a pipeline stage's received input is a leaf that
    # shares the saved tensor's storage too, but an activation)
    if isinstance(leaf, nn.Parameter) and _local(leaf).untyped_storage() is storage:
        return "param"
    whole = storage.nbytes() == leaf.numel() * tensor.element_size()
    return "cast" if cast and whole else "activation"


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
