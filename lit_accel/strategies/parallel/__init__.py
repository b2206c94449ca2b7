"""AccelParallel: pipeline, tensor and sharded data parallel (3D), in small modules (``docs/architecture.md``)."""

from lit_accel.strategies.parallel.accel_parallel import AccelParallel

__all__ = ["AccelParallel"]
