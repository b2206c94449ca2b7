"""Training strategies: :class:`AccelDDP`, :class:`AccelFSDP`, :class:`AccelParallel` (``"accel_ddp"`` ...).

:class:`AccelParts` is the mixin that gives a strategy lit_accel's shared parts (``docs/extending.md``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lit_accel.strategies.accel_ddp import AccelDDP
from lit_accel.strategies.accel_fsdp import AccelFSDP
from lit_accel.strategies.parallel import AccelParallel, ParallelPlan, PipelineLoss
from lit_accel.strategies.parts import AccelParts

# At import, like Lightning's own strategies, so Trainer(strategy="accel_ddp") works once lit_accel is imported.
# Idempotent: register_strategies skips names already present (re-imports, reloads).
AccelDDP.register_strategies(StrategyRegistry)
AccelFSDP.register_strategies(StrategyRegistry)
AccelParallel.register_strategies(StrategyRegistry)

__all__ = ["AccelDDP", "AccelFSDP", "AccelParallel", "AccelParts", "ParallelPlan", "PipelineLoss"]
