"""Two nodes of two CPU processes each, on one machine: AccelDDP's global batch and per-node SyncBatchNorm groups.

Run once per node, as in README.md ("Launch on N GPUs, with torchrun, on several nodes") and tests/test_multinode.py::

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29500 \\
        tests/scripts/multinode.py &
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29500 \\
        tests/scripts/multinode.py

The Trainer is ``Trainer(num_nodes=2, devices=2, accelerator="cpu", strategy=AccelDDP(...))`` with
``global_batch_size=32`` (= 4 per device x 4 devices x 2 accumulation) and ``AccelSyncBatchNorm(group_size=2)``:
BatchNorm statistics are synchronised within each node only. The model's first layer is a BatchNorm of the input, so
its running statistics depend on the data alone and a test can replay them. Each rank writes ``rank<N>.pt`` to
``--output-dir`` at the end of fit, or right after optimizer step ``--dump-step``. ``--kill-rank R --kill-step S``
makes global rank R SIGKILL itself when optimizer step S begins.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_accel import AccelDDP, AccelSyncBatchNorm

GLOBAL_BATCH, MICRO_BATCH, SAMPLES, FEATURES = 32, 4, 256, 8
# Printed by the rank that kills itself, with the wall-clock time, so the test can time the shutdown.
KILL_MARKER = "KILLING_MYSELF_AT"

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name now warns); both stop the broadcast.
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
BUFFER_SYNC_OFF = {("forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"): False}


def dataset() -> TensorDataset:
    """Fixed data; samples 2 and 3 of every 4 (node 1's, under a 4-rank sequential sampler) are shifted by +3."""
    generator = torch.Generator().manual_seed(0)
    shift = 3.0 * (torch.arange(SAMPLES) % 4 >= 2).float().unsqueeze(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator) + shift
    y = torch.randn(SAMPLES, 2, generator=generator)
    return TensorDataset(x, y)


class InputBNModel(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.output_dir, self.dump_step = args.output_dir, args.dump_step
        self.kill_rank, self.kill_step = args.kill_rank, args.kill_step
        self.dumped = False
        self.net = nn.Sequential(nn.BatchNorm1d(FEATURES), nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.kill_rank and self.global_step == self.kill_step:
            print(f"{KILL_MARKER} {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no traceback, no cleanup
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        # Not shuffled, so the test knows which samples each rank saw (Lightning's sampler is turned off below).
        sampler = DistributedSampler(dataset(), self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(dataset(), batch_size=MICRO_BATCH, sampler=sampler)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Right after optimizer step `dump_step` (the micro-batch whose step made global_step reach it), once.
        if self.trainer.global_step == self.dump_step and not self.dumped:
            self._dump()

    def on_train_end(self) -> None:
        if not self.dumped:
            self._dump()

    def _dump(self) -> None:
        trainer, strategy, bn = self.trainer, self.trainer.strategy, self.net[0]
        dump = {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "global_batch_size": strategy.global_batch_size,
            "micro_batch_size": strategy.micro_batch_size,
            "sync_bn_group_size": strategy.sync_bn_group_size,
            "running_mean": bn.running_mean.clone(),
            "running_var": bn.running_var.clone(),
            "params": {name: p.detach().clone() for name, p in self.named_parameters()},
        }
        torch.save(dump, self.output_dir / f"rank{trainer.global_rank}.pt")
        self.dumped = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/multinode"), help="where each rank writes")
    parser.add_argument("--max-steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--dump-step", type=int, default=None, help="write the dumps after this step, not at the end")
    parser.add_argument("--kill-rank", type=int, default=None, help="global rank that SIGKILLs itself")
    parser.add_argument("--kill-step", type=int, default=None, help="optimizer step at which it does")
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        num_nodes=2,
        devices=2,
        accelerator="cpu",
        strategy=AccelDDP(
            global_batch_size=GLOBAL_BATCH,
            sync_batchnorm=AccelSyncBatchNorm(group_size=2),
            # DDP's default copies rank 0's running statistics to every rank at the start of each accumulation
            # window, so node 1's would be node 0's plus a micro-batch: per-node statistics need it off.
            **BUFFER_SYNC_OFF,
        ),
        max_steps=args.max_steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(InputBNModel(args))


if __name__ == "__main__":
    main()
