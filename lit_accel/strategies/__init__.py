"""Training strategies: :class:`AccelDDP`."""

from lit_accel.strategies.accel_ddp import AccelDDP

__all__ = ["AccelDDP"]
