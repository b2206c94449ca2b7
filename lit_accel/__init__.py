"""lit_accel: fast, correct and observable multi-GPU mixed-precision training for PyTorch Lightning.

Example::

    from lightning.pytorch import Trainer
    from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor

    trainer = Trainer(
        accelerator="gpu",
        devices=8,
        strategy=AccelDDP(global_batch_size=1024),
        plugins=[AccelPrecision("bf16-mixed")],
        callbacks=[LossScaleMonitor(), EfficiencyMonitor()],
    )
"""

__version__ = "0.2.0"

from lit_accel.callbacks import EfficiencyMonitor, LossScaleMonitor
from lit_accel.meters import EfficiencyMeter, LossScaleMeter
from lit_accel.plugins import AccelPrecision, AccelSyncBatchNorm, DynamicGradScaler, SyncBatchNorm
from lit_accel.protocols import (
    BusBytes,
    CommStats,
    CommStatsProvider,
    ScalerStats,
    ScalerStatsProvider,
    SkippedStepRecord,
)
from lit_accel.strategies import AccelDDP, AccelFSDP, AccelParts

__all__ = [
    "AccelDDP",
    "AccelFSDP",
    "AccelParts",
    "AccelPrecision",
    "AccelSyncBatchNorm",
    "BusBytes",
    "CommStats",
    "CommStatsProvider",
    "DynamicGradScaler",
    "EfficiencyMeter",
    "EfficiencyMonitor",
    "LossScaleMeter",
    "LossScaleMonitor",
    "ScalerStats",
    "ScalerStatsProvider",
    "SkippedStepRecord",
    "SyncBatchNorm",
]
