"""Callbacks: the monitors, :class:`HangWatchdog` and :class:`NonFiniteGuard`.

Each adapts a Lightning-free core in :mod:`lit_accel.meters`, usable from raw PyTorch and Fabric loops.
"""

from lit_accel.callbacks.efficiency_monitor import EfficiencyMonitor
from lit_accel.callbacks.hang_watchdog import HangWatchdog
from lit_accel.callbacks.loss_scale_monitor import LossScaleMonitor
from lit_accel.callbacks.memory_monitor import MemoryMonitor
from lit_accel.callbacks.nonfinite_guard import NonFiniteGuard

__all__ = [
    "EfficiencyMonitor",
    "HangWatchdog",
    "LossScaleMonitor",
    "MemoryMonitor",
    "NonFiniteGuard",
]
