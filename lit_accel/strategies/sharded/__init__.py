"""The sharded strategy family: AccelFSDP (FSDP2 over the world) and AccelParallel (pipeline x tensor x sharded data).

They build, run and check a ``ParallelPlan`` (``lit_accel/layout/``, ``docs/architecture.md``).
"""

from lit_accel.layout.plan import ParallelPlan  # re-exported: its home before lit_accel.layout
from lit_accel.strategies.sharded.accel_fsdp import AccelFSDP
from lit_accel.strategies.sharded.accel_parallel import AccelParallel
from lit_accel.strategies.sharded.pipeline_loss import PipelineLoss

__all__ = ["AccelFSDP", "AccelParallel", "ParallelPlan", "PipelineLoss"]
