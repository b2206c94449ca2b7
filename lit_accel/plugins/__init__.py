"""Precision and layer-sync plugins: :class:`AccelPrecision`."""

from lit_accel.plugins.accel_precision import AccelPrecision

__all__ = ["AccelPrecision"]
