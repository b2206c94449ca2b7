"""A 2-process AccelDDP or AccelFSDP job whose address space is capped after start-up, for micro_batch_size="auto".

Run by tests/strategies/test_micro_batching.py: ``python micro_batch_oom.py --budget-mb 47 --out result.pt``
(``--strategy fsdp`` for AccelFSDP; with
MALLOC_ARENA_MAX=1 and MALLOC_MMAP_THRESHOLD_=65536 in the environment, so that glibc's arenas do not eat the cap
and freed blocks give their address space back). Each rank caps its
own address space at start of training to its current size plus the budget; the full per-device batch then cannot
allocate its activations, and the strategy must find the largest micro-batch that does.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lit_accel import AccelDDP, AccelFSDP
from tests.helpers import make_dataset, make_loader
from tests.strategies.test_accel_fsdp import full_state

HIDDEN, SAMPLES, PER_DEVICE = 131072, 128, 32


class Wide(pl.LightningModule):
    """Activations of HIDDEN floats per sample and layer: the micro-batch decides the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class Cap(pl.Callback):
    def __init__(self, budget: int) -> None:
        self.budget = budget

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the autograd engine starts its worker threads at the first backward: their 8 MB stacks must not eat the cap
        torch.ones(1, requires_grad=True).sum().backward()
        limit = _vm_size() + self.budget
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mb", type=float, required=True)
    parser.add_argument("--micro", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="store_true", help="one process on the joint batch, no cap")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Wide()
    micro = args.micro if args.micro == "auto" else int(args.micro)
    devices = 1 if args.reference else 2
    cls = AccelFSDP if args.strategy == "fsdp" and not args.reference else AccelDDP
    strategy = cls(global_batch_size=2 * PER_DEVICE, micro_batch_size=None if args.reference else micro,
                   sync_batchnorm=False)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[] if args.reference else [Cap(int(args.budget_mb * 1e6))],
    )  # fmt: skip
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = () if args.reference else (rank, 2)
    batch = 2 * PER_DEVICE if args.reference else PER_DEVICE  # the joint batch of both ranks, or one rank's
    trainer.fit(model, make_loader(make_dataset(SAMPLES, in_features=8), batch, *sampler))
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    state = full_state(model)  # (gathers FSDP's shards: on every rank)
    if trainer.global_rank == 0:
        torch.save({"state": state, "micro": strategy.micro_batch_size}, args.out)


if __name__ == "__main__":
    main()
