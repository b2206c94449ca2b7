"""Meters: the arithmetic of lit_accel's monitors as plain objects, usable from any loop (raw PyTorch, Fabric).

The callbacks in :mod:`lit_accel.callbacks` are thin Lightning adapters over these, as Fabric's ``Throughput`` is to
Lightning's ``ThroughputMonitor``. :class:`ProgressWatchdog` is the hang watchdog's core (``HangWatchdog`` adapts it).
"""

from lit_accel.meters.efficiency import EfficiencyMeter
from lit_accel.meters.loss_scale import LossScaleMeter
from lit_accel.meters.memory import MemoryMeter
from lit_accel.meters.progress_watchdog import Position, ProgressWatchdog

__all__ = ["EfficiencyMeter", "LossScaleMeter", "MemoryMeter", "Position", "ProgressWatchdog"]
