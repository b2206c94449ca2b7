"""Training strategies: :class:`AccelDDP`, :class:`AccelFSDP`, :class:`AccelParallel` (``"accel_ddp"`` ...).

``ddp/`` holds AccelDDP's own pieces, ``sharded/`` the sharded family, ``parts/`` what every strategy shares.

:class:`AccelParts` is the mixin that gives a strategy lit_accel's shared parts (``docs/extending.md``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lit_accel.strategies.ddp import AccelDDP
from lit_accel.strategies.parts.accel_parts import AccelParts
from lit_accel.strategies.sharded import AccelFSDP, AccelParallel, ParallelPlan, PipelineLoss

# At import, like Lightning's own strategies, so Trainer(strategy="accel_ddp") works once lit_accel is imported.
# Idempotent: register_strategies skips names already present (re-imports, reloads).
AccelDDP.register_strategies(StrategyRegistry)
AccelFSDP.register_strategies(StrategyRegistry)
AccelParallel.register_strategies(StrategyRegistry)

__all__ = ["AccelDDP", "AccelFSDP", "AccelParallel", "AccelParts", "ParallelPlan", "PipelineLoss"]
