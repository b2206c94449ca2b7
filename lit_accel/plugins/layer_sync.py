"""``AccelSyncBatchNorm``: Lightning's layer-sync plugin, made portable, group-aware and exactly reversible.

Lightning's ``TorchSyncBatchNorm`` is CUDA only, syncs the whole world and reverts to ``_BatchNormXd`` rather than the
user's classes; what this one does instead: ``docs/strategies.md``, SyncBatchNorm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import LayerSync
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lit_accel.plugins._module_swap import swap_modules
from lit_accel.plugins._routed_batchnorm import RoutedForward, is_routed
from lit_accel.plugins.sync_batchnorm import SyncBatchNorm
from lit_accel.utilities._validation import check_choice, check_int

__all__ = ["AccelSyncBatchNorm", "count_batchnorm_layers"]

_Implementation = Literal["auto", "portable", "torch"]
# Where a converted layer keeps the module it replaced. Stored in ``__dict__`` directly: assigning a Module through
# ``Module.__setattr__`` would register it as a child and change ``state_dict`` keys, ``parameters()`` and ``.to()``.
_ORIGINAL = "_lit_accel_original"
# The device a process-group backend carries tensors on; gloo, mpi and ucc carry CPU tensors.
_BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}
#: What ``"auto"`` picks on CUDA with NCCL: lit_accel's layer (no host sync; torch's forward has one per layer) until
#: ``benchmarks/gpu_check.py --checks syncbn``, which times both, says torch's is faster.
AUTO_ON_CUDA_NCCL: Literal["portable", "torch"] = "portable"


def count_batchnorm_layers(model: Module) -> int:
    """Number of BatchNorm layers in ``model``, synchronised ones included; a layer shared at two places counts once."""
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def is_synced_batchnorm(module: Module) -> bool:
    """Whether ``module`` is a BatchNorm that all-reduces its statistics (torch's ``SyncBatchNorm``, ours, routed)."""
    return isinstance(module, (SyncBatchNorm, torch.nn.SyncBatchNorm)) or is_routed(module)


class AccelSyncBatchNorm(LayerSync):
    """Synchronise BatchNorm statistics across ranks (or groups of ranks) on any backend, and undo it exactly.

    Args:
        group_size: synchronise within consecutive groups of this many ranks (ranks ``[0..k-1]``, ``[k..2k-1]``, ...),
            e.g. the GPUs of one node. ``None`` (default) synchronises the whole world; ``1`` is local BatchNorm (no
            communication). Must divide the world size (checked in :meth:`apply`).
        implementation: ``"portable"`` (:class:`~lit_accel.plugins.sync_batchnorm.SyncBatchNorm`, any backend),
            ``"torch"`` (``torch.nn.SyncBatchNorm``, CUDA/XPU/HPU only) or ``"auto"`` (default: the portable one unless
            ``AUTO_ON_CUDA_NCCL`` says torch's on CUDA with NCCL). Same result.

    Raises:
        TypeError: ``group_size`` is not an int or None. ValueError: it is below 1, or ``implementation`` is unknown.

    Example::

        # 2 nodes x 8 GPUs: BatchNorm statistics over the 8 GPUs of each node
        trainer = Trainer(accelerator="gpu", devices=8, num_nodes=2, strategy="ddp", plugins=[AccelSyncBatchNorm(8)])
    """

    def __init__(self, group_size: int | None = None, implementation: _Implementation = "auto") -> None:
        check_int("AccelSyncBatchNorm", "group_size", group_size, allow_none=True, example=8)
        check_choice("AccelSyncBatchNorm", "implementation", implementation, get_args(_Implementation), "'auto'")
        self.group_size = group_size
        self.implementation: _Implementation = implementation
        #: Number of layers the last :meth:`apply` synchronised (replaced, or ``routed``).
        self.num_converted = 0
        #: Qualified names of the layers the last :meth:`apply` synchronised in place: their class has its own forward
        #: (timm's ``BatchNormAct2d``), which runs as written with its ``F.batch_norm`` calls synchronised (by the
        #: portable implementation, whatever ``implementation`` says).
        self.routed: list[str] = []
        #: The implementation the last :meth:`apply` used: ``"portable"`` or ``"torch"`` (None before).
        self.resolved_implementation: Literal["portable", "torch"] | None = None
        #: The process group of this rank's layers (None: the whole world).
        self.process_group: Any | None = None

    @override
    def apply(self, model: Module, groups: Sequence[Sequence[int]] | None = None) -> Module:
        """Convert every BatchNorm layer of ``model`` in place to a synchronised one sharing its parameters and buffers.

        Call it on every rank, after the default process group exists (it creates the sub-groups). Layers already
        synchronised are left alone; a class with its own forward keeps it (``routed``); a BatchNorm root is replaced
        (returned). ``groups``: every group of ranks that synchronise together, each rank in one (a strategy's data
        dimension, e.g. AccelParallel's: the ranks with one pipeline and tensor coordinate); ``None``: consecutive
        ranks in groups of ``group_size``.

        Raises:
            ValueError: ``group_size`` does not divide the world size, or ``implementation="torch"`` while the layers
                will run on CPU.
        """
        self.process_group = self._create_group() if groups is None else _group_of(groups)
        # a class with its own forward is routed first (and then counts as synchronised); the others are replaced
        self.routed = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm) and _own_forward(m)]
        for name in self.routed:
            RoutedForward(model.get_submodule(name), name, self.process_group)
        todo = [m for m in model.modules() if isinstance(m, _BatchNorm) and not is_synced_batchnorm(m)]
        # modules() and named_modules() list a shared layer once, and it is converted once
        self.num_converted = len(todo) + len(self.routed)
        self.resolved_implementation = self._resolve_implementation(todo[0]) if todo else None
        return swap_modules(model, self._to_sync) if todo else model

    @override
    def revert(self, model: Module) -> Module:
        """Put back the modules :meth:`apply` replaced (current parameters and statistics) and the routed forwards."""
        for layer in model.modules():
            if is_routed(layer):
                layer.forward.remove()
        return swap_modules(model, _original_with_current_tensors)

    def _create_group(self) -> Any | None:
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        k = self.group_size
        if k is not None and world_size % k != 0:
            raise ValueError(
                f"AccelSyncBatchNorm(group_size={k}): the group size must divide the world size {world_size}"
                f" (groups are consecutive ranks [0..k-1], [k..2k-1], ...). Valid group sizes for world size"
                f" {world_size}: {[d for d in range(1, world_size + 1) if world_size % d == 0]}. Pick one of them, or"
                " group_size=None for the whole world."
            )
        if k is None or k == world_size:
            return None
        # Every rank creates every group, in the same order (a new_group requirement), via torch's own helper.
        group, _ = dist.new_subgroups(group_size=k)
        return group

    def _resolve_implementation(self, layer: Module) -> Literal["portable", "torch"]:
        device = next((t.device.type for t in (*layer.parameters(), *layer.buffers())), "cpu")
        backend = str(dist.get_backend(self.process_group)) if dist.is_available() and dist.is_initialized() else ""
        if device in ("cpu", "meta"):
            # Lightning applies layer sync *before* moving the model to its device: the backend tells where the layers
            # will run (NCCL carries only CUDA tensors).
            device = _BACKEND_DEVICE.get(backend, device)
        if self.implementation == "portable":
            return "portable"
        if self.implementation == "torch":
            if device in ("cpu", "meta"):
                raise ValueError(
                    f"AccelSyncBatchNorm(implementation='torch'): the layers will run on CPU (device {device!r},"
                    f" backend {backend or 'none'!r}), but torch.nn.SyncBatchNorm only runs on CUDA/XPU/HPU devices."
                    " Use implementation='portable' (or 'auto'), which runs on every backend."
                )
            return "torch"
        return AUTO_ON_CUDA_NCCL if device == "cuda" and "nccl" in backend else "portable"

    def _to_sync(self, bn: Module) -> Module | None:
        if not isinstance(bn, _BatchNorm) or is_synced_batchnorm(bn):  # (routed layers count as synchronised)
            return None
        cls = torch.nn.SyncBatchNorm if self.resolved_implementation == "torch" else SyncBatchNorm
        # Built on the meta device: its own tensors are replaced by the original's right away.
        sync = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta")
        sync.process_group = self.process_group
        # Share every parameter and buffer *object* (user subclasses may add some), so optimizer state and the
        # state_dict keys are those of the original layer.
        for registry in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
            getattr(sync, registry).clear()
            getattr(sync, registry).update(getattr(bn, registry))
        sync.training = bn.training
        if hasattr(bn, "qconfig"):  # as torch.nn.SyncBatchNorm.convert_sync_batchnorm does
            sync.qconfig = bn.qconfig
        sync.__dict__[_ORIGINAL] = bn
        return sync


def _own_forward(layer: Module) -> bool:
    """Whether a BatchNorm's class computes more than BatchNorm (timm's ``BatchNormAct2d``: its activation and drop).

    A synchronised layer in its place would run only the normalisation and so train another model: such a layer keeps
    its forward, routed (``_routed_batchnorm.py``).
    """
    return not is_synced_batchnorm(layer) and type(layer).forward is not _BatchNorm.forward


def _group_of(groups: Sequence[Sequence[int]]) -> Any | None:
    """This rank's group of ``groups`` (every rank creates all of them, as ``new_group`` requires); None: the world."""
    if len(groups) == 1 and len(groups[0]) == dist.get_world_size():
        return None
    group, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in groups])
    return group


def _original_with_current_tensors(module: Module) -> Module | None:
    original = module.__dict__.get(_ORIGINAL)
    if original is not None:
        # The synced layer holds the current tensors: `.to()`/`.cuda()` after apply replaced its buffers (and, with
        # swapped module params, its parameters), not the original's.
        original._parameters.update(module._parameters)
        original._buffers.update(module._buffers)
        original.training = module.training
    return original
