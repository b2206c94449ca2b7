"""Count the FLOPs of real training work with :class:`torch.utils.flop_counter.FlopCounterMode`, split by dtype.

``FlopCounterMode`` is a ``TorchDispatchMode``: while it is active, every matmul, convolution and attention kernel
that runs on this thread (and on the autograd engine's threads, which inherit the mode) adds its analytic FLOP count
(2 x multiply-accumulates) to a total. It counts the forward *and* the backward, and only the gradients autograd
actually computes: a first layer whose input needs no gradient costs no input-gradient matmul. Element-wise ops
(activations, losses, optimizer updates) count zero, as in the usual MFU convention (PaLM, Chowdhery et al. 2022,
appendix B: "model FLOPs" are the matmul FLOPs of forward and backward).

The monitor enters the mode in one hook and leaves it in a later one, so it counts the first real training
micro-batch: no extra forward/backward, no perturbed BatchNorm statistics or RNG state.

**By dtype.** Under mixed precision one step runs matmuls in several formats (an fp32 head, a bf16 body, fp8
linears), each with its own peak. :class:`FlopCounter` wraps each formula of the mode's own registry
(``FlopCounterMode.flop_registry``, called with the op's real arguments as ``register_flop_formula(get_raw=True)``
formulas are) so the count it returns is also booked under the dtype the op ran in:

- ``"fp8"`` when an operand is a float8 tensor (``torch._scaled_mm``) or a tensor subclass whose inner data is
  float8 (torchao's ``Float8TrainingTensor`` reports its high-precision dtype; its ``_data`` is float8, found through
  the subclass protocol ``__tensor_flatten__``); ``"fp4"`` likewise for ``float4_e2m1fn_x2``. A subclass whose
  flatten context says ``emulate=True`` (torchao's ``ScaledMMConfig``, the CPU path) multiplies the dequantized
  values in fp32 (``torch.mm`` on ``.float()`` copies), so its FLOPs are booked as ``"fp32"``: they ran at the fp32
  rate, not the fp8 one;
- ``"tf32"`` for a float32 op on an NVIDIA GPU of compute capability >= 8.0 when PyTorch lets that op use TF32
  (matmuls: ``torch.backends.cuda.matmul.fp32_precision``, which ``allow_tf32`` and
  ``set_float32_matmul_precision`` also set; convolutions: ``torch.backends.cudnn.conv.fp32_precision``, set by
  ``cudnn.allow_tf32``; fp32 attention kernels pick their own math, the matmul switch stands in), else ``"fp32"``
  (always on CPU);
- ``"bf16"``, ``"fp16"``, ``"fp64"``; any other dtype by its torch name (``"int8"``).

The split sums to the mode's total, except under an eager ``torch.cond``, where the mode counts only the costlier
branch while the formulas see both: the split is then scaled to the total.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from lit_accel.utilities._peak_flops import fp32_uses_tf32

__all__ = ["FlopCount", "FlopCounter", "compute_dtype", "measure_flops"]

_NAMED = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_FP8 = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_FP4 = frozenset(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))
_aten = torch.ops.aten
# cuDNN's TF32 switch governs these; every other registered op (mm, bmm, attention) follows the matmul switch.
_CONV_OPS = frozenset(
    {_aten.convolution, _aten._convolution, _aten.cudnn_convolution, _aten.convolution_overrideable}
    | {_aten._slow_conv2d_forward, _aten.convolution_backward}
)


class FlopCount(int):
    """A FLOP total (an ``int``: ``FlopCounterMode``'s total) that also says in which dtype the FLOPs ran.

    Example::

        >>> count = FlopCount(10, {"bf16": 8, "fp32": 2})
        >>> count.total, count.by_dtype["bf16"], count / 2
        (10, 8, 5.0)

    Args:
        total: the FLOP count.
        by_dtype: FLOPs per dtype key (see the module docstring); only dtypes that ran appear. Sums to ``total``.

    Raises:
        ValueError: ``by_dtype`` does not sum to ``total``.
    """

    by_dtype: dict[str, int]

    def __new__(cls, total: int, by_dtype: Mapping[str, int]) -> FlopCount:
        if sum(by_dtype.values()) != total:
            raise ValueError(
                f"FlopCount(total={total}): by_dtype={dict(by_dtype)} sums to {sum(by_dtype.values())}."
                " Fix: pass a split that sums to the total."
            )
        self = super().__new__(cls, total)
        self.by_dtype = dict(by_dtype)
        return self

    @property
    def total(self) -> int:
        """The FLOP count, as a plain ``int``."""
        return int(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return FlopCount, (int(self), self.by_dtype)

    def __repr__(self) -> str:
        return f"FlopCount(total={int(self)}, by_dtype={self.by_dtype})"


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _emulated(t: torch.Tensor) -> bool:
    """Whether a wrapper subclass says it emulates its low-precision matmul (``emulate`` in its flatten context)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return False
    _, context = t.__tensor_flatten__()
    for value in context.values() if isinstance(context, dict) else ():
        # torchao: a LinearMMConfig, a NamedTuple of one ScaledMMConfig per gemm, each with an ``emulate`` flag.
        for item in value if isinstance(value, tuple) else (value,):
            if getattr(item, "emulate", False) is True:
                return True
    return False


def _storage_dtypes(t: torch.Tensor) -> Iterator[torch.dtype]:
    """The dtype a tensor reports, and those of the inner tensors of a wrapper subclass (recursively)."""
    yield t.dtype
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name, None)
            if isinstance(inner, torch.Tensor):
                yield from _storage_dtypes(inner)


@functools.cache
def _cuda_has_tf32(index: int | None) -> bool:
    # TF32 tensor cores arrived with Ampere (8.0); ROCm's flags mean something else, so it keeps fp32.
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def compute_dtype(op: Any, args: Any, kwargs: Any) -> str:
    """The dtype key an op's FLOPs are booked under, from its operands (see the module docstring).

    Args:
        op: the ``OpOverloadPacket`` (``torch.ops.aten.mm``); it picks the TF32 switch that applies.
        args: the op's positional arguments as dispatched.
        kwargs: its keyword arguments.

    Returns:
        ``"fp8"``, ``"fp4"``, ``"tf32"``, ``"fp32"`` (emulated fp8 too), ``"bf16"``, ``"fp16"``, ``"fp64"``, another
        torch dtype's name (``"int64"``), or ``"unknown"`` for an op without tensor arguments.
    """
    tensors = list(_tensors((args, kwargs)))
    if not tensors:
        return "unknown"
    first = next((t for t in tensors if t.dtype.is_floating_point), tensors[0])
    quantized = _quantized_key(tensors)
    if quantized in ("fp4", "fp8"):
        return quantized
    dtype = torch.float32 if quantized == "fp32" else first.dtype
    if dtype == torch.float32 and _runs_in_tf32(op, first):
        return "tf32"
    return _NAMED.get(dtype) or str(dtype).removeprefix("torch.")


def _quantized_key(tensors: list[Any]) -> str | None:
    """``"fp4"``/``"fp8"`` for low-precision operands, ``"fp32"`` where they are emulated, None for neither."""
    storage = {d for t in tensors for d in _storage_dtypes(t)}
    if storage & (_FP4 | _FP8) and any(_emulated(t) for t in tensors):
        return "fp32"  # dequantized and multiplied in fp32 (module docstring)
    if storage & _FP4:  # before fp8: MX fp4 operands carry float8_e8m0 scales
        return "fp4"
    return "fp8" if storage & _FP8 else None


def _runs_in_tf32(op: Any, first: Any) -> bool:
    """Whether an fp32 ``op`` on ``first``'s CUDA device runs in TF32 (its switch on, an Ampere or later device)."""
    if first.device.type != "cuda":
        return False
    return fp32_uses_tf32("conv" if op in _CONV_OPS else "matmul") and _cuda_has_tf32(first.device.index)


class FlopCounter:
    """A :class:`FlopCounterMode` that can be started in one callback hook and stopped in another.

    Counts, like the mode, what runs on this thread and in the backward it drives, and books each op's FLOPs
    under the dtype it ran in (module docstring). :meth:`stop` returns a :class:`FlopCount`, an ``int``.

    Example::

        counter = FlopCounter()
        counter.start()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).sum()
        loss.backward()
        count = counter.stop()  # forward + backward matmul FLOPs
        count.by_dtype  # {"bf16": ..., "fp32": ...}: the head ran outside autocast
    """

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self._eager: Any = None  # torch.compile's stance while counting
        # Formulas return ints (floats only where a sparsity hint scales them): keep ints exact past 2**53.
        self._by_dtype: defaultdict[str, Any] = defaultdict(int)

    @property
    def active(self) -> bool:
        """Whether the counter is running."""
        return self._mode is not None

    def _booked(self, op: Any, formula: Callable[..., Any]) -> Callable[..., Any]:
        def formula_by_dtype(*args: Any, out_val: Any = None, **kwargs: Any) -> Any:
            flops = formula(*args, out_val=out_val, **kwargs)
            if flops:
                self._by_dtype[compute_dtype(op, args, kwargs)] += flops
            return flops

        return formula_by_dtype

    def start(self) -> None:
        """Start counting on this thread (and the autograd threads it drives)."""
        if self._mode is not None:
            raise RuntimeError("FlopCounter.start() called twice without stop().")
        # display=False: FlopCounterMode would otherwise print a per-module table on exit.
        mode = FlopCounterMode(display=False)
        # Every registry value takes the op's raw arguments plus out_val (non-raw formulas come shape-wrapped).
        mode.flop_registry = {op: self._booked(op, f) for op, f in mode.flop_registry.items()}
        self._by_dtype.clear()
        # Compiled code runs eagerly while the mode is on: torch 2.11-2.13's dynamo, meeting a dispatch mode at a
        # frame's first call, marks the frame "run eagerly" for good, without a word (pytorch #190286). The FLOPs
        # are the same; the frames compile at their next call.
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        mode.__enter__()
        self._mode = mode

    def stop(self) -> FlopCount:
        """Stop counting and return the FLOPs counted since :meth:`start`, with their split by dtype."""
        if self._mode is None:
            raise RuntimeError("FlopCounter.stop() called without start().")
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        eager, self._eager = self._eager, None
        eager.__exit__(None, None, None)
        return _reconciled(int(mode.get_total_flops()), self._by_dtype)


def _reconciled(total: int, by_dtype: Mapping[str, Any]) -> FlopCount:
    booked = sum(by_dtype.values())
    if booked == total and all(isinstance(v, int) for v in by_dtype.values()):
        return FlopCount(total, {k: v for k, v in by_dtype.items() if v})
    if booked <= 0:
        return FlopCount(total, {"unknown": total} if total else {})
    # Eager torch.cond (module docstring) or fractional formulas: scale the split to the mode's total.
    split = {k: int(v * total // booked) for k, v in by_dtype.items()}
    split[max(split, key=split.__getitem__)] += total - sum(split.values())  # rounding remainder
    return FlopCount(total, {k: v for k, v in split.items() if v})


def measure_flops(fn: Callable[[], Any]) -> FlopCount:
    """FLOPs of the matmuls (forward and backward) that ``fn`` runs, split by dtype.

    Args:
        fn: a callable that runs the work to count, e.g. ``lambda: model(x).sum().backward()``.

    Returns:
        The total FLOP count (2 x multiply-accumulates), an ``int`` with ``.by_dtype``.

    Example::

        mlp = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
        flops = measure_flops(lambda: mlp(torch.randn(1, 1024)).sum().backward())
        # forward 2*2*1024*4096 + weight grads 2*2*1024*4096 + one input grad 2*1024*4096, all "fp32" on CPU
    """
    counter = FlopCounter()
    counter.start()
    try:
        fn()
    finally:
        flops = counter.stop()
    return flops
