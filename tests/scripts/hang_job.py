"""A CPU job (Lightning's popen launcher, ``AccelDDP(hang_timeout=T)``) in which one rank hangs or works long on
purpose; run by tests/callbacks/test_hang_watchdog.py.

Usage::

    python tests/scripts/hang_job.py --mode sleep --devices 2 --rank 1 --step 3 --timeout 5
    python tests/scripts/hang_job.py --mode dataloader --devices 4 --rank 2 --step 3 --timeout 5
    python tests/scripts/hang_job.py --mode worker --devices 2 --rank 1 --step 3 --timeout 5
    python tests/scripts/hang_job.py --mode divergent --devices 2 --rank 1 --step 3 --timeout 5
    python tests/scripts/hang_job.py --mode slow_ok --devices 2 --timeout 5 --max-steps 60
    python tests/scripts/hang_job.py --mode epoch_end --rank 0 --sleep 45 --strategy accel_fsdp  # default: no timeout

``sleep``: the rank blocks forever in ``training_step``. ``dataloader``/``worker``: its dataset blocks forever when
fetching the batch of that step (in the main process / in a DataLoader worker). ``divergent``: after validating at
that step, every other rank makes an ``all_reduce`` in ``on_validation_epoch_end``, the rank skips it and enters the
next training step's collectives. In these modes the watchdog must end the job within seconds of the timeout.
With ``--bystander`` each rank first starts a child process of its own, which the ended job must leave running.
``slow_ok`` runs a slow first step, a slow rank, a 20 s validation and slow checkpoint saves, none of which may
trigger it. ``epoch_end``: the rank works ``--sleep`` seconds in a callback's ``on_train_epoch_end`` of the first of
two 8-step epochs: a healthy job that the default strategy (no ``--timeout``) must finish.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lit_accel import AccelDDP, AccelFSDP

# Printed by the hanging rank just before it blocks, with the wall-clock time, so the test can time the detection.
HANG_MARKER = "HANG_STARTS_AT"
BYSTANDER_MARKER = "BYSTANDER_PID"  # printed with the pid of each rank's own child (``--bystander``)
BYSTANDER_S = 600.0  # how long a bystander lives at most: the test kills it once the job has ended
BATCH = 4


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _block_forever(what: str) -> None:
    print(f"{HANG_MARKER} {time.time():.3f} rank {_rank()} {what}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


class _Data(Dataset):
    """Random rows; on the hanging rank, the first item of batch ``hang_step`` never comes back."""

    def __init__(self, hang_rank: int | None, hang_step: int) -> None:
        self.hang_rank, self.hang_at = hang_rank, hang_step * BATCH
        self.calls = 0
        self.data = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.calls == self.hang_at and _rank() == self.hang_rank:
            _block_forever("in Dataset.__getitem__")
        self.calls += 1
        return self.data[index]


class _Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        args, rank = self.args, self.global_rank
        if args.mode == "sleep" and rank == args.rank and self.global_step == args.step:
            _block_forever("in training_step")
        if args.mode == "slow_ok":
            if self.global_step == 0:
                time.sleep(args.timeout + 3)  # a first step slower than the timeout: compilation, FLOP counting
            elif rank == 1:
                time.sleep(0.3)  # a slow but progressing rank: the others wait for it every step
        return self.net(batch).pow(2).mean()

    def on_validation_epoch_end(self) -> None:
        args = self.args
        if args.mode == "divergent":
            if self.global_rank == args.rank:
                print(f"{HANG_MARKER} {time.time():.3f} rank {args.rank} skips the all_reduce", file=sys.stderr)
            else:
                dist.all_reduce(torch.ones(1))  # the metric sync that rank ``args.rank`` skips

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.args.mode == "slow_ok":  # 2 batches: 20 s on rank 0, 2 s on the others, which then wait for it
            time.sleep(10.0 if self.global_rank == 0 else 1.0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.args.mode == "slow_ok" and self.global_rank == 0:
            time.sleep(2 * self.args.timeout)  # a slow filesystem; the other ranks wait in the save barrier

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Rank0Work(pl.Callback):
    """One rank's own work between epochs (samples, an evaluation, an upload): legitimate, however long."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == 0:
            print(
                f"{HANG_MARKER} {time.time():.3f} rank {self.rank} works in on_train_epoch_end",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = ("sleep", "dataloader", "worker", "divergent", "slow_ok", "epoch_end")
    parser.add_argument("--mode", choices=modes, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rank", type=int, default=1, help="the rank that hangs")
    parser.add_argument("--step", type=int, default=3, help="the optimizer step at which it hangs")
    parser.add_argument("--timeout", type=float, default=None, help="hang_timeout= (default: the strategy's)")
    parser.add_argument("--strategy", choices=("accel_ddp", "accel_fsdp"), default="accel_ddp")
    parser.add_argument("--sleep", type=float, default=45.0, help="epoch_end: seconds of the rank's own work")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--root", default=None, help="Trainer(default_root_dir=): where checkpoints go")
    parser.add_argument("--bystander", action="store_true", help="each rank starts a child the job does not own")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    hang_rank = args.rank if args.mode in ("dataloader", "worker") else None
    loader = DataLoader(_Data(hang_rank, args.step), batch_size=BATCH, num_workers=int(args.mode == "worker"))
    slow_ok, epoch_end = args.mode == "slow_ok", args.mode == "epoch_end"
    callbacks: list[pl.Callback] = [_Rank0Work(args.rank, args.sleep)] if epoch_end else []
    if slow_ok:
        callbacks.append(ModelCheckpoint(every_n_train_steps=20, save_top_k=-1))
    strategy = (AccelFSDP if args.strategy == "accel_fsdp" else AccelDDP)(hang_timeout=args.timeout)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        max_steps=-1 if epoch_end else args.max_steps,
        max_epochs=2 if epoch_end else None,
        limit_train_batches=8 if epoch_end else None,
        val_check_interval=30 if slow_ok else args.step + 1,  # divergent: validate after step ``--step``
        limit_val_batches={"slow_ok": 2, "divergent": 1}.get(args.mode, 0),
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=slow_ok,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    val = DataLoader(_Data(None, 0), batch_size=BATCH)
    if args.bystander:  # a child of the user's own (a logger's service, say): ending the job must leave it alone
        bystander = multiprocessing.Process(target=time.sleep, args=(BYSTANDER_S,), daemon=True)
        bystander.start()
        print(f"{BYSTANDER_MARKER} {bystander.pid}", file=sys.stderr, flush=True)
    trainer.fit(_Model(args), loader, val)
    print(f"rank {trainer.global_rank} finished {trainer.global_step} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
