"""lit_accel: fast, correct and observable multi-GPU mixed-precision training for PyTorch Lightning.

Example::

    from lightning.pytorch import Trainer
    from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor, MemoryMonitor

    trainer = Trainer(
        accelerator="gpu",
        devices=8,
        strategy=AccelDDP(global_batch_size=1024),
        plugins=[AccelPrecision("bf16-mixed")],
        callbacks=[LossScaleMonitor(), EfficiencyMonitor(), MemoryMonitor()],  # + AccelDDP's HangWatchdog
    )
"""

__version__ = "0.2.0"

from lit_accel.callbacks import (
    EfficiencyMonitor,
    HangWatchdog,
    LossScaleMonitor,
    MemoryMonitor,
    NonFiniteGuard,
)
from lit_accel.layout import BatchPlan, ParallelPlan
from lit_accel.meters import EfficiencyMeter, LossScaleMeter, MemoryMeter, ProgressWatchdog
from lit_accel.planning import Plan, PlanRow, plan
from lit_accel.plugins import (
    AccelPrecision,
    AccelSyncBatchNorm,
    DynamicGradScaler,
    Float8Conversion,
    Float8Report,
    SyncBatchNorm,
)
from lit_accel.protocols import (
    BusBytes,
    CommStats,
    CommStatsProvider,
    CommTiming,
    ExposedComm,
    PipelineBubble,
    PipelineBubbleStats,
    PipelineStages,
    ScalerStats,
    ScalerStatsProvider,
    SkippedStepRecord,
    StagePlacement,
)
from lit_accel.strategies import AccelDDP, AccelFSDP, AccelParallel, AccelParts, PipelineLoss
from lit_accel.utilities._warnings import install as _install_warning_format

_install_warning_format()  # our warnings on one line, without the source line (utilities/_warnings.py)

__all__ = [
    "AccelDDP",
    "AccelFSDP",
    "AccelParallel",
    "AccelParts",
    "AccelPrecision",
    "AccelSyncBatchNorm",
    "BatchPlan",
    "BusBytes",
    "CommStats",
    "CommStatsProvider",
    "CommTiming",
    "DynamicGradScaler",
    "EfficiencyMeter",
    "EfficiencyMonitor",
    "ExposedComm",
    "Float8Conversion",
    "Float8Report",
    "HangWatchdog",
    "LossScaleMeter",
    "LossScaleMonitor",
    "MemoryMeter",
    "MemoryMonitor",
    "NonFiniteGuard",
    "ParallelPlan",
    "PipelineBubble",
    "PipelineBubbleStats",
    "PipelineLoss",
    "PipelineStages",
    "Plan",
    "PlanRow",
    "ProgressWatchdog",
    "ScalerStats",
    "ScalerStatsProvider",
    "SkippedStepRecord",
    "StagePlacement",
    "SyncBatchNorm",
    "plan",
]
