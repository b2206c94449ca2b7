"""AccelParallel: pipeline, tensor and sharded data parallel (3D), in small modules (``docs/architecture.md``)."""

from lit_accel.strategies.parallel.accel_parallel import AccelParallel
from lit_accel.strategies.parallel.pipeline_loss import PipelineLoss
from lit_accel.strategies.parallel.plan import ParallelPlan

__all__ = ["AccelParallel", "ParallelPlan", "PipelineLoss"]
