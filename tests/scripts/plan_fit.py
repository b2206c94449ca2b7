"""A 2-process job of one layout whose address space is capped before the model exists, for lit_accel.plan's fits.

Run by tests/planning/test_plan_fit.py: ``python plan_fit.py --layout fsdp --budget-mb 180`` (with
MALLOC_ARENA_MAX=1, MALLOC_MMAP_THRESHOLD_=65536 and OMP_NUM_THREADS=1 in the environment, so that glibc's arenas do
not eat the cap and freed blocks give their address space back). The model (``tests/helpers/gpt.py``'s GPT at
``SIZES``) is built in ``configure_model``; each rank caps its address space in the callbacks' ``setup`` (before
``configure_model``) at its size then plus the budget, so the budget is all the layout has for its model, state,
activations and the runtime. Each rank prints the address space the fit added at its largest.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lit_accel import plan
from tests.helpers.gpt import GPT, Embed, GPTBlock, Head, token_dataset

#: a few hundred MB per rank under every layout of 2 processes: far above the runtime's own footprint (10-20 MB)
SIZES = {"depth": 4, "width": 512, "heads": 4, "vocab": 8192, "context": 128}
LOADED, STEPS = 8, 3


class LazyGPT(GPT):
    """``tests/helpers/gpt.py``'s GPT built in ``configure_model`` (nothing allocated before the fit)."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        width = SIZES["width"]
        self.embed = Embed(SIZES["vocab"], SIZES["context"], width)
        self.blocks = nn.ModuleList([GPTBlock(width, SIZES["heads"]) for _ in range(SIZES["depth"])])
        self.head = Head(SIZES["vocab"], width)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Cap(pl.Callback):
    """Caps the address space at ``budget`` bytes over its size before the model is built."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the autograd engine starts its worker threads at the first backward: their stacks must not eat the cap
        torch.ones(1, requires_grad=True).sum().backward()
        self.start = _status_bytes("VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (self.start + self.budget, resource.RLIM_INFINITY))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the address space the fit added at its largest (the budget it needed), for the record
        print(f"rank {trainer.global_rank} footprint_mb {(_status_bytes('VmPeak') - self.start) / 1e6:.1f}")


def loaded_batch() -> tuple[torch.Tensor, ...]:
    """One device's loaded batch, as the job loads it (what the plan is given)."""
    return tuple(token_dataset(LOADED, vocab=SIZES["vocab"], context=SIZES["context"]).tensors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", required=True, help="a lit_accel.plan layout name of 2 processes")
    parser.add_argument("--budget-mb", type=float, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    with torch.device("meta"):
        strategy: Any = plan(GPT(**SIZES), world_size=2, layouts=[args.layout])[args.layout].strategy()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[Cap(int(args.budget_mb * 1e6))],
    )  # fmt: skip
    data = token_dataset(64, vocab=SIZES["vocab"], context=SIZES["context"])
    trainer.fit(LazyGPT(), DataLoader(data, batch_size=LOADED))
    print("trained")


if __name__ == "__main__":
    main()
