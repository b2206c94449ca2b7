"""The sharded strategy family: AccelFSDP (FSDP2 over the world) and AccelParallel (pipeline x tensor x sharded data).

``plan.py`` resolves a layout once (``ParallelPlan``); the other modules build, run and check it
(``docs/architecture.md``).
"""

from lit_accel.strategies.sharded.accel_fsdp import AccelFSDP
from lit_accel.strategies.sharded.accel_parallel import AccelParallel
from lit_accel.strategies.sharded.pipeline_loss import PipelineLoss
from lit_accel.strategies.sharded.plan import ParallelPlan

__all__ = ["AccelFSDP", "AccelParallel", "ParallelPlan", "PipelineLoss"]
