"""AccelParallel: pipeline, tensor and sharded data parallel (3D), in small modules (``docs/architecture.md``)."""

from lit_accel.strategies.parallel.accel_parallel import AccelParallel
from lit_accel.strategies.parallel.pipeline_loss import PipelineLoss

__all__ = ["AccelParallel", "PipelineLoss"]
