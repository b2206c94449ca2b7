"""AccelDDP and its own pieces: DDP communication hooks by name, and the all-reduce counting without one."""

from lit_accel.strategies.ddp.accel_ddp import AccelDDP

__all__ = ["AccelDDP"]
