"""``BatchNormSync``: which SyncBatchNorm plugin a strategy installs while fitting, shared by AccelDDP and AccelFSDP.

Lightning's Trainer assigns ``strategy._layer_sync`` after the strategy is built (from ``Trainer(sync_batchnorm=)`` or
``plugins=``), so a strategy decides in ``setup()``, before ``super().setup()`` applies it: a user's own LayerSync
plugin is respected, Lightning's CUDA-only ``TorchSyncBatchNorm`` is replaced by the portable one, and one rank (or a
group of one) gets plain BatchNorm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm, count_batchnorm_layers

if TYPE_CHECKING:
    from torch import nn

__all__ = ["BatchNormSync"]


class BatchNormSync:
    """Resolve a strategy's ``sync_batchnorm`` argument into the LayerSync plugin to apply.

    Args:
        owner: the strategy's class name, for messages.
        sync_batchnorm: ``True`` (the portable SyncBatchNorm over all ranks), ``False``, or a configured
            :class:`~lit_accel.AccelSyncBatchNorm` (e.g. ``AccelSyncBatchNorm(group_size=8)``).

    Raises:
        TypeError: ``sync_batchnorm`` is neither a bool nor an ``AccelSyncBatchNorm``.

    Example::

        sync = BatchNormSync("AccelDDP", AccelSyncBatchNorm(group_size=8))
        strategy._layer_sync = sync.resolve(strategy._layer_sync, module, world_size=16)
    """

    def __init__(self, owner: str, sync_batchnorm: bool | AccelSyncBatchNorm = True) -> None:
        if not isinstance(sync_batchnorm, (bool, AccelSyncBatchNorm)):
            raise TypeError(
                f"{owner}(sync_batchnorm={sync_batchnorm!r}): expected True, False or an AccelSyncBatchNorm. Fix: pass"
                " e.g. sync_batchnorm=AccelSyncBatchNorm(group_size=8)."
            )
        self.owner = owner
        self.enabled = sync_batchnorm is not False
        self.plugin = sync_batchnorm if isinstance(sync_batchnorm, AccelSyncBatchNorm) else AccelSyncBatchNorm()
        self._told_no_batchnorm = False

    @property
    def group_size(self) -> int | None:
        """Ranks per SyncBatchNorm group (``None``: all ranks)."""
        return self.plugin.group_size

    def resolve(self, current: LayerSync | None, module: nn.Module | None, world_size: int) -> LayerSync | None:
        """The LayerSync plugin to apply, given what the Trainer put on the strategy (``current``).

        Raises:
            ValueError: ``sync_batchnorm=False`` with ``Trainer(sync_batchnorm=True)``, or a group size that does not
                divide ``world_size``.
        """
        self._tell_no_batchnorm(module)
        if current is not None and not isinstance(current, TorchSyncBatchNorm):
            if isinstance(current, AccelSyncBatchNorm):
                self.plugin = current  # so that group_size reports the Trainer's plugin, not the default
            return current  # the user's own LayerSync plugin (ours configured their way, or theirs): respect it
        if not self.enabled:
            if current is not None:
                raise ValueError(
                    f"{self.owner}(sync_batchnorm=False) contradicts Trainer(sync_batchnorm=True). Fix: drop one."
                )
            return None
        group_size = self._checked_group_size(world_size)
        if current is not None:
            rank_zero_info(
                f"{self.owner}: Trainer(sync_batchnorm=True) is replaced by lit_accel's SyncBatchNorm (any backend;"
                " the original BatchNorm classes come back at teardown)."
            )
        if world_size == 1 or group_size == 1:
            return None  # a group of one rank has nothing to synchronise with: plain BatchNorm is exact, and cheaper
        return self.plugin

    def _tell_no_batchnorm(self, module: nn.Module | None) -> None:
        if self.enabled and module is not None and not self._told_no_batchnorm and not count_batchnorm_layers(module):
            self._told_no_batchnorm = True
            rank_zero_info(
                f"{self.owner}: the model has no BatchNorm layer; pass sync_batchnorm=False to silence this."
            )

    def _checked_group_size(self, world_size: int) -> int | None:
        group_size = self.plugin.group_size
        if group_size is not None and world_size % group_size:
            allowed = [k for k in range(1, world_size + 1) if world_size % k == 0]
            raise ValueError(
                f"{self.owner}(sync_batchnorm=AccelSyncBatchNorm(group_size={group_size})) must divide the world size"
                f" {world_size}. Allowed: {allowed} or None (all ranks). Fix: pass e.g. the devices per node."
            )
        return group_size
