"""Training strategies: :class:`AccelDDP`, registered with Lightning as ``"accel_ddp"`` and its launch variants."""

from lightning.pytorch.strategies import StrategyRegistry

from lit_accel.strategies.accel_ddp import AccelDDP

# At import, like Lightning's own strategies, so Trainer(strategy="accel_ddp") works once lit_accel is imported.
# Idempotent: AccelDDP.register_strategies skips names already present (re-imports, reloads).
AccelDDP.register_strategies(StrategyRegistry)

__all__ = ["AccelDDP"]
