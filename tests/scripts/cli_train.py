"""A tiny LightningCLI program (the tests' ``BNModel`` on a fixed data set); run by tests/test_cli.py as a real job.

Usage::

    python tests/scripts/cli_train.py fit --config CONFIG.yaml --trainer.strategy=lit_accel.AccelDDP \\
        --trainer.strategy.global_batch_size=16 --trainer.devices=2 --trainer.accelerator=cpu

Lightning's popen launcher re-runs the same command line for rank 1, so both ranks parse and build the same objects.
With ``--trainer.use_distributed_sampler=false`` each rank reads the fixed data through a non-shuffling
``DistributedSampler`` (``tests/helpers/models.py::make_loader``), so a test can replay the run in one process. At the
end of fit every rank writes ``rank<N>.pt`` to ``trainer.default_root_dir``: its parameters and buffers, and what the
strategy and precision plugin really applied (accumulation, global batch, SyncBN group, loss scale, skipped steps).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make ``tests.helpers`` importable
    sys.path.insert(0, str(REPO))

import lit_accel  # noqa: E402, F401 - registers the strategy names (accel_ddp, accel_fsdp, ...)
from tests.helpers.models import BNModel, make_dataset, make_loader  # noqa: E402


class CLIModel(BNModel):
    """``BNModel`` that can overflow on purpose and dumps what the run applied at the end of fit.

    Args:
        in_features, hidden, out_features, lr, optimizer, batchnorm: as for ``BNModel``.
        overflow_at_step: make the loss infinite at this optimizer step (an fp16 overflow: the step is skipped).
    """

    def __init__(
        self,
        in_features: int = 8,
        hidden: int = 16,
        out_features: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        batchnorm: bool = True,
        overflow_at_step: int | None = None,
    ) -> None:
        super().__init__(in_features, hidden, out_features, lr, optimizer, batchnorm)
        self.overflow_at_step = overflow_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == self.overflow_at_step else loss

    def on_train_end(self) -> None:
        trainer, strategy, plugin = self.trainer, self.trainer.strategy, self.trainer.precision_plugin
        state = {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "strategy": type(strategy).__name__,
            "global_batch_size": getattr(strategy, "global_batch_size", None),
            "sync_bn_group_size": getattr(strategy, "sync_bn_group_size", None),
            "precision_plugin": type(plugin).__name__,
            "loss_scale": getattr(plugin, "loss_scale", None),
            "skipped_steps": getattr(plugin, "skipped_steps", None),
            "callbacks": [type(callback).__name__ for callback in trainer.callbacks],
            "state_dict": {key: value.detach().clone() for key, value in self.state_dict().items()},
        }
        torch.save(state, Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.pt")


class CLIData(pl.LightningDataModule):
    """``make_dataset(samples)`` in sequential micro-batches; sharded without shuffling on several ranks.

    Args:
        samples: size of the fixed data set.
        batch_size: samples per device per micro-batch.
    """

    def __init__(self, samples: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        self.samples = samples
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert trainer is not None
        dataset = make_dataset(self.samples)
        if trainer.world_size > 1:
            return make_loader(dataset, self.batch_size, trainer.global_rank, trainer.world_size)
        return make_loader(dataset, self.batch_size)


def main() -> None:
    LightningCLI(CLIModel, CLIData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
