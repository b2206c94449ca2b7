"""Precision and layer-sync plugins: :class:`AccelPrecision` with its :class:`DynamicGradScaler`, and SyncBatchNorm.

:class:`AccelSyncBatchNorm` also works with Lightning's own ``DDPStrategy`` (``Trainer(plugins=[...])``).
"""

from lit_accel.plugins.accel_precision import AccelPrecision
from lit_accel.plugins.float8 import Float8Conversion, Float8Report
from lit_accel.plugins.grad_scaler import DynamicGradScaler
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.plugins.sync_batchnorm import SyncBatchNorm
from lit_accel.protocols import ScalerStats

__all__ = [
    "AccelPrecision",
    "AccelSyncBatchNorm",
    "DynamicGradScaler",
    "Float8Conversion",
    "Float8Report",
    "ScalerStats",
    "SyncBatchNorm",
]
