"""A 2-process CPU job (AccelDDP, popen launcher) in which one rank fails on purpose; run by tests/test_rank_failure.py.

Usage::

    python tests/scripts/rank_failure.py --mode raise --rank 1 --step 3
    python tests/scripts/rank_failure.py --mode kill --rank 1 --step 3

The job must end non-zero within seconds (not at the 30-minute collective timeout), with the failing rank's error
visible. The model has a BatchNorm layer, so AccelDDP's SyncBatchNorm adds collectives to every forward and backward,
and the fp16 plugin and both monitors take part, as in a real run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor

FAILURE_MESSAGE = "rank {rank} failed on purpose at step {step}"
# Printed by the failing rank just before it fails, with the wall-clock time, so the test can time the shutdown.
FAILING_MARKER = "FAILING_NOW_AT"


class _FailingModel(pl.LightningModule):
    def __init__(self, mode: str, rank: int, step: int) -> None:
        super().__init__()
        self.mode, self.fail_rank, self.fail_step = mode, rank, step
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            print(f"{FAILING_MARKER} {time.time():.3f}", file=sys.stderr, flush=True)
            if self.mode == "raise":
                raise RuntimeError(FAILURE_MESSAGE.format(rank=self.fail_rank, step=self.fail_step))
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no traceback, no cleanup
        (x,) = batch
        return self.net(x).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("raise", "kill"), required=True)
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--step", type=int, default=3, help="the optimizer step at which it fails")
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(512, 8))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=AccelDDP(),
        plugins=[AccelPrecision("16-mixed")],
        callbacks=[LossScaleMonitor(), EfficiencyMonitor(print_summary=False)],
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_FailingModel(args.mode, args.rank, args.step), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
