"""Precision and layer-sync plugins.

:class:`AccelPrecision` is the precision plugin (also at ``lit_accel.AccelPrecision``). The portable
:class:`SyncBatchNorm` and its Lightning ``LayerSync`` plugin :class:`AccelSyncBatchNorm` are what ``AccelDDP`` uses;
they also work with Lightning's own ``DDPStrategy`` (``Trainer(plugins=[AccelSyncBatchNorm()])``).
"""

from lit_accel.plugins._grad_scaler import DynamicGradScaler, ScalerStats
from lit_accel.plugins.accel_precision import AccelPrecision
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.plugins.sync_batchnorm import SyncBatchNorm

__all__ = ["AccelPrecision", "AccelSyncBatchNorm", "DynamicGradScaler", "ScalerStats", "SyncBatchNorm"]
