"""Callbacks: :class:`LossScaleMonitor` and :class:`EfficiencyMonitor`."""

from lit_accel.callbacks.efficiency_monitor import EfficiencyMonitor
from lit_accel.callbacks.loss_scale_monitor import LossScaleMonitor

__all__ = ["EfficiencyMonitor", "LossScaleMonitor"]
