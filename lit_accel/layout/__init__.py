"""A run's layout before any process starts: :class:`ParallelPlan`, :class:`BatchPlan` and the rules they are made of.

``plan.py`` resolves a sharded layout once (mesh sizes, schedule, stage split, tensor plan, sharding choices) without
a process group; ``batch_plan.py`` is the arithmetic of a global batch. ``mesh``, ``schedules``, ``stages``,
``tensor_plan`` and ``blocks`` are the rules behind them; ``chain`` and ``tensor_check`` hold a model to them (the model
contract: a split or a tensor plan never trains a different model; the first before the split, the second on the
first training batch). The strategies build and run these plans and the planner (``lit_accel.plan``) predicts their
memory: both import this package, which imports neither.
"""

from lit_accel.layout.batch_plan import BatchPlan
from lit_accel.layout.plan import ParallelPlan

__all__ = ["BatchPlan", "ParallelPlan"]
