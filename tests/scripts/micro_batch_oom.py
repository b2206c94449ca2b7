"""A 2-process AccelDDP or AccelFSDP job whose address space is capped after start-up, for micro_batch_size="auto".

Run by tests/strategies/test_micro_batching_capped.py: ``python micro_batch_oom.py --budget-mb 47 --out result.pt``
(``--strategy fsdp`` for AccelFSDP, ``--model issue`` for issue #47's model; with MALLOC_ARENA_MAX=1 and
MALLOC_MMAP_THRESHOLD_=65536 in the environment, so that glibc's arenas do not eat the cap and freed blocks give their
address space back). Each rank caps its own address space at start of training to its current size plus the budget;
the full per-device batch then cannot allocate its activations, and the strategy must find the largest micro-batch
that does. The result holds the weights, the micro-batch used and the footprint: the largest growth of the address
space over the fit on any rank (``VmPeak`` less ``VmSize`` at the start of training), which is the smallest budget
that run fits in, and the seconds ``trainer.fit`` took.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lit_accel import AccelDDP, AccelFSDP
from tests.helpers import make_dataset, make_loader
from tests.strategies.test_accel_fsdp import full_state

SAMPLES = 256


class Wide(pl.LightningModule):
    """Activations of ``hidden`` floats per sample and layer: the micro-batch decides the memory.

    ``elementwise`` layers between the two Linear ones (issue #47's model: 65536 wide, four of them).
    """

    def __init__(self, hidden: int = 131072, elementwise: int = 0) -> None:
        super().__init__()
        layers = [nn.GELU(), nn.SiLU(), nn.Tanh(), nn.Softplus()][:elementwise] or [nn.ReLU()]
        self.net = nn.Sequential(nn.Linear(8, hidden), *layers, nn.Linear(hidden, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


#: model, loaded batch per device, optimizer steps (batches per device)
MODELS = {"wide": ((131072, 0), 32, 2), "issue": ((65536, 4), 64, 2)}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Cap(pl.Callback):
    """Caps the address space at ``budget`` bytes over its size when training starts, and records the footprint."""

    def __init__(self, budget: int) -> None:
        self.budget, self.start, self.peak_before = budget, 0, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the autograd engine starts its worker threads at the first backward: their 8 MB stacks must not eat the cap
        torch.ones(1, requires_grad=True).sum().backward()
        self.start, self.peak_before = _status_bytes("VmSize"), _status_bytes("VmPeak")
        resource.setrlimit(resource.RLIMIT_AS, (self.start + self.budget, resource.RLIM_INFINITY))

    def footprint(self) -> int:
        """The address space the fit added at its largest (VmPeak moved past its start-up high-water mark)."""
        peak = _status_bytes("VmPeak")
        if peak <= self.peak_before:  # start-up reached higher than the fit: the fit's own peak is hidden
            raise RuntimeError(f"VmPeak {peak} did not pass its start-up value: no footprint can be read")
        return peak - self.start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mb", type=float, required=True)
    parser.add_argument("--micro", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="store_true", help="one process on the joint batch, no cap")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--model", choices=tuple(MODELS), default="wide")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    (hidden, elementwise), per_device, steps = MODELS[args.model]
    model = Wide(hidden, elementwise)
    micro = args.micro if args.micro == "auto" else int(args.micro)
    devices = 1 if args.reference else 2
    cls = AccelFSDP if args.strategy == "fsdp" and not args.reference else AccelDDP
    strategy = cls(global_batch_size=2 * per_device, micro_batch_size=None if args.reference else micro,
                   sync_batchnorm=False)  # fmt: skip
    cap = Cap(int(args.budget_mb * 1e6))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[] if args.reference else [cap],
    )  # fmt: skip
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = () if args.reference else (rank, 2)
    batch = 2 * per_device if args.reference else per_device  # the joint batch of both ranks, or one rank's
    started = time.perf_counter()
    trainer.fit(model, make_loader(make_dataset(SAMPLES, in_features=8), batch, *sampler))
    fit_s = time.perf_counter() - started
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    footprint = torch.tensor([0 if args.reference else cap.footprint()])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(footprint, op=torch.distributed.ReduceOp.MAX)
    state = full_state(model)  # (gathers FSDP's shards: on every rank)
    if trainer.global_rank == 0:
        result = {"state": state, "micro": strategy.micro_batch_size, "footprint": int(footprint), "fit_s": fit_s}
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
