"""Device memory for ``micro_batch_size="auto"``: what is free, the peak of a probe, and optimizer state to come.

CUDA: the caching allocator's counters (``memory_allocated``, ``max_memory_allocated``, ``mem_get_info``) and the
per-process fraction it may reserve (``set_per_process_memory_fraction``). CPU
(Linux): the process's address-space limit (``RLIMIT_AS``) and ``MemAvailable``, and the resident-set high-water mark
``VmHWM``, which writing ``5`` to ``/proc/self/clear_refs`` resets (``man 5 proc``); under an address-space limit also
the growth of ``VmPeak``, the mapped size's high-water mark, when the block raised it.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CudaMemory", "PeakMemory", "available_bytes", "optimizer_state_bytes"]


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def _mem_available() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class CudaMemory:
    """What a CUDA device and torch's caching allocator tell this process (bytes), and what it may still allocate."""

    free: int  #: free on the device (``mem_get_info``): what other processes hold is not free
    total: int  #: the device's memory
    reserved: int  #: what this process's allocator holds (``memory_reserved``)
    allocated: int  #: what its tensors use of that (``memory_allocated``)
    fraction: float = 1.0  #: the share of ``total`` the allocator may reserve (``set_per_process_memory_fraction``)

    @classmethod
    def read(cls, device: torch.device) -> CudaMemory:
        free, total = torch.cuda.mem_get_info(device)
        # set_per_process_memory_fraction's, or PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        return cls(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device), fraction)

    @property
    def allocatable(self) -> int:
        """The device's free memory plus the unused cache, never past the fraction's cap less what tensors use.

        The allocator refuses a block that would take what it reserves past ``fraction x total``, after releasing
        its unused cache; so under the cap it may still allocate ``fraction x total - allocated``.
        """
        by_device = self.free + self.reserved - self.allocated
        by_fraction = int(self.fraction * self.total) - self.allocated
        return max(min(by_device, by_fraction), 0)


def available_bytes(device: torch.device, local_ranks: int = 1) -> int | None:
    """Bytes this rank may still allocate on ``device``, or ``None`` when it cannot be known.

    CUDA: :attr:`CudaMemory.allocatable` (what the device has free and torch's cache holds unused, within the
    per-process fraction). CPU: the smaller of the address space left under ``RLIMIT_AS`` and this rank's share of
    ``MemAvailable`` (the ``local_ranks`` processes of a node share it).
    """
    if device.type == "cuda":
        return CudaMemory.read(device).allocatable
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _status_kib("VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        limits.append(soft - size)
    available = _mem_available()
    if available is not None:
        limits.append(available // max(local_ranks, 1))
    return min(limits) if limits else None


class PeakMemory:
    """The peak bytes above the start that the code inside a ``with measure():`` block held on ``device``.

    Example::

        peak = PeakMemory(torch.device("cuda", 0))
        with peak.measure():
            loss = model(x).sum(); loss.backward()
        print(peak.bytes)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes = 0

    @staticmethod
    def supported(device: torch.device) -> bool:
        """Whether peaks can be measured on ``device`` (CUDA, or a Linux CPU with a resettable ``VmHWM``)."""
        return device.type == "cuda" or (device.type == "cpu" and _status_kib("VmHWM") is not None)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Record the peak of the block (reset at its start) in :attr:`bytes`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - start
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start, size, size_peak = _status_kib("VmRSS") or 0, _status_kib("VmSize") or 0, _status_kib("VmPeak") or 0
        yield
        self.bytes = max(0, (_status_kib("VmHWM") or 0) - start)
        capped = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
        new_peak = _status_kib("VmPeak") or 0
        if capped and new_peak > size_peak:
            # an address-space cap counts mapped memory, not touched pages; VmPeak cannot be reset, so the block's
            # own peak is known only when it raised the process's
            self.bytes = max(self.bytes, new_peak - size)


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)  # a DTensor (FSDP2): this rank's shard
    return to_local() if callable(to_local) else param


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes the optimizers' first ``step`` will allocate for their state (0 for state that exists already).

    Found by stepping a copy of each optimizer over meta tensors of the same shapes; an optimizer that cannot be
    stepped that way (a closure-driven one, a custom one) is taken to keep two values per parameter, as Adam does.
    """
    total = 0
    for optimizer in optimizers:
        if optimizer.state:
            continue
        params = [_local(p) for group in optimizer.param_groups for p in group["params"]]
        try:
            total += _meta_state_bytes(optimizer)
        except Exception:  # any failure of the copy means "unknown": assume Adam's two moments
            total += 2 * sum(p.numel() * p.element_size() for p in params)
    return total


def _meta_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = (t for _, state in meta_step_states(optimizer) for t in state)
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "meta")


def meta_step_states(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each parameter of ``optimizer`` with the state tensors its first ``step`` allocates.

    From a copy of the optimizer stepped over meta tensors of the parameters' local shapes (nothing is allocated;
    per-parameter scalars such as Adam's step counter stay on the CPU). Raises what the copy raises.
    """
    groups, pairs = [], []
    for group in optimizer.param_groups:
        metas = []
        for param in group["params"]:
            meta = torch.empty_like(_local(param), device="meta").requires_grad_(param.requires_grad)
            meta.grad = torch.empty_like(meta)
            metas.append(meta)
            pairs.append((param, meta))
        groups.append({**group, "params": metas, **({"fused": False} if group.get("fused") else {})})
    clone = type(optimizer)(groups)
    with torch.no_grad():
        clone.step()
    return [(p, [t for t in clone.state.get(m, {}).values() if isinstance(t, torch.Tensor)]) for p, m in pairs]
