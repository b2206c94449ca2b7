"""Callbacks: the monitors, :class:`HangWatchdog` and :class:`NonFiniteGuard`.

:class:`ProgressWatchdog` is the watchdog's Lightning-free core, for raw PyTorch and Fabric loops.
"""

from lit_accel.callbacks.efficiency_monitor import EfficiencyMonitor
from lit_accel.callbacks.hang_watchdog import HangWatchdog
from lit_accel.callbacks.loss_scale_monitor import LossScaleMonitor
from lit_accel.callbacks.memory_monitor import MemoryMonitor
from lit_accel.callbacks.nonfinite_guard import NonFiniteGuard
from lit_accel.callbacks.progress_watchdog import ProgressWatchdog

__all__ = [
    "EfficiencyMonitor",
    "HangWatchdog",
    "LossScaleMonitor",
    "MemoryMonitor",
    "NonFiniteGuard",
    "ProgressWatchdog",
]
