"""A raw PyTorch DDP loop (no Lightning) watched by ``ProgressWatchdog``, in which one rank blocks forever.

Usage::

    python -m torch.distributed.run --nproc-per-node 2 tests/scripts/hang_raw.py --rank 1 --step 3 --timeout 5

Run by tests/callbacks/test_hang_watchdog.py: under torchrun (an external launcher, whose agent hosts the store) the
watchdog must report the stuck rank on every rank and end each of them with exit code 124 within seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lit_accel.meters import ProgressWatchdog

HANG_MARKER = "HANG_STARTS_AT"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=1, help="the rank that blocks")
    parser.add_argument("--step", type=int, default=3, help="the step at which it blocks")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watchdog = ProgressWatchdog(args.timeout, interval=0.5, on_hang="exit")
    watchdog.start()
    try:
        for step in range(50):
            watchdog.enter("data", step)
            batch = torch.randn(4, 8)
            watchdog.enter("forward", step)
            if rank == args.rank and step == args.step:
                print(f"{HANG_MARKER} {time.time():.3f} rank {rank}", file=sys.stderr, flush=True)
                time.sleep(3600)
            loss = model(batch).pow(2).mean()
            watchdog.enter("backward", step)
            loss.backward()
            watchdog.enter("optimizer_step", step)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        watchdog.stop()  # after a verdict, a peer's exit makes a collective raise: this ends the rank with the verdict
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
