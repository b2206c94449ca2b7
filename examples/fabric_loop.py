"""lit_accel without the Trainer: a Lightning Fabric loop with fp16 loss scaling and the monitors' figures.

Fabric runs the loop you write; lit_accel gives it the loss scaler and the meters behind its callbacks:

* fp16 autocast with ``DynamicGradScaler`` (hysteresis, min/max scale, on-device counters) through Fabric's own
  ``MixedPrecision("16-mixed", device, scaler=...)`` plugin -- on CPU too, where ``Fabric(precision="16-mixed")``
  silently becomes bf16;
* ``EfficiencyMeter`` (samples/s, step time, data wait, TFLOP/s, MFU, straggler spread) and ``LossScaleMeter`` (loss
  scale, skipped steps, skip rate, growths, back-offs), printed every ``--log-every`` steps under the keys the
  ``EfficiencyMonitor`` (``perf/``) and ``LossScaleMonitor`` (``amp/``) log, and the monitor's table at the end.

Fabric's DDP strategy does not count its all-reduces (it has no ``comm_stats``), so there are no comm figures here;
``AccelDDP`` under the Trainer has them.

Commands::

    # two CPU processes joined by gloo: Fabric starts the second one itself
    python examples/fabric_loop.py --accelerator cpu --devices 2
    # an overflow on rank 1 at step 5: both ranks skip that step, the scale halves, skipped_steps counts it
    python examples/fabric_loop.py --accelerator cpu --devices 2 --overflow-at-step 5
    # GPUs (MFU needs the dense peak of one device, e.g. 989e12 for an H100/H200 SXM at fp16)
    python examples/fabric_loop.py --accelerator cuda --devices 8 --peak-flops 989e12
    # the same under torchrun (Fabric joins its processes)
    torchrun --nproc_per_node=2 examples/fabric_loop.py --accelerator cpu --devices 2

Rank 0 prints one line per logging step (throughput, step time, data wait, loss scale, and the steps the scaler
skipped, by number), then the table; ``--json`` adds each step's figures as ``metrics {json}`` and ``summary {json}``
at the end (what ``tests/examples/test_fabric_loop.py`` reads). The data are scikit-learn's 1,797 handwritten digits
(8x8, no download), classified by a small MLP.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import DynamicGradScaler, EfficiencyMeter, LossScaleMeter
from lit_accel.meters.tables import comm_note, efficiency_table

PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric_loop.py",
        description="A Fabric DDP loop with lit_accel's loss scaler and efficiency/loss-scale meters.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    group = parser.add_argument_group("distribution and precision")
    group.add_argument("--accelerator", default="cpu", help="cpu, cuda, auto, ...")
    group.add_argument("--devices", type=int, default=2, help="processes per node")
    group.add_argument("--num-nodes", type=int, default=1, help="number of nodes")
    group.add_argument("--strategy", default="ddp", help="a Fabric strategy name")
    group.add_argument("--precision", choices=PRECISIONS, default="16-mixed", help="16-mixed: fp16 + loss scaling")
    group.add_argument("--init-scale", type=float, default=2.0**16, help="DynamicGradScaler's initial loss scale")
    group.add_argument("--hysteresis", type=int, default=1, help="overflows tolerated before the scale backs off")
    group.add_argument("--growth-interval", type=int, default=2000, help="clean steps before the scale grows")

    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, default=40, help="optimizer steps")
    group.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    group.add_argument("--hidden", type=int, default=256, help="MLP width")
    group.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    group.add_argument("--seed", type=int, default=0, help="random seed")
    group.add_argument(
        "--overflow-at-step",
        type=int,
        action="append",
        default=[],
        help="make rank 1's loss infinite in this optimizer step (counted from 1, as printed; repeatable): the step is "
        "skipped on every rank",
    )

    group = parser.add_argument_group("metering")
    group.add_argument("--log-every", type=int, default=10, help="print the meters every this many optimizer steps")
    group.add_argument(
        "--json", action="store_true", help="also print each logging step's figures as 'metrics {json}', and 'summary'"
    )
    group.add_argument("--warmup-steps", type=int, default=3, help="optimizer steps the efficiency meter ignores")
    group.add_argument("--peak-flops", type=float, default=None, help="dense peak FLOP/s of one device, for MFU")
    return parser


def build_precision(args: argparse.Namespace, device_type: str) -> MixedPrecision | None:
    """Fabric's own plugin for fp16/bf16 autocast; fp16 gets lit_accel's scaler instead of a plain GradScaler."""
    if args.precision == "32-true":
        return None
    if args.precision == "bf16-mixed":
        return MixedPrecision("bf16-mixed", device_type)
    scaler = DynamicGradScaler(
        init_scale=args.init_scale, hysteresis=args.hysteresis, growth_interval=args.growth_interval
    )
    return MixedPrecision("16-mixed", device_type, scaler=scaler)


def digits_loader(batch_size: int) -> DataLoader:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    # drop_last: equal micro-batches on every rank (Fabric's DistributedSampler pads the last one otherwise)
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True, drop_last=True)


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))


def flops_per_sample(hidden: int, batch_size: int) -> float:
    """Training FLOPs (forward + backward) of one sample, counted by torch's FlopCounterMode on the meta device."""
    with torch.device("meta"):
        model, x = build_model(hidden), torch.empty(batch_size, 64)
    return measure_flops(model, lambda: model(x), lambda logits: logits.sum()) / batch_size


def train(args: argparse.Namespace) -> dict[str, Any]:
    device_type = "cuda" if args.accelerator in ("cuda", "gpu") else args.accelerator
    plugin = build_precision(args, device_type)
    fabric = Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        plugins=[plugin] if plugin is not None else None,
    )
    fabric.launch()  # as a script: Fabric starts the other processes, each re-running this file
    fabric.seed_everything(args.seed)
    if fabric.device.type == "cpu":
        torch.set_num_threads(1)  # one core per process: more threads per rank only contend on a small CPU

    model = build_model(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(digits_loader(args.batch_size))

    meter = EfficiencyMeter(
        fabric.device,
        world_size=fabric.world_size,
        warmup_steps=args.warmup_steps,
        flops_per_sample=flops_per_sample(args.hidden, args.batch_size),
        peak_flops=args.peak_flops,
        comm_stats=None,  # Fabric's DDP does not count its all-reduces
    )
    scale = LossScaleMeter(warmup_steps=0)
    if plugin is not None and plugin.scaler is not None:
        plugin.scaler.to(fabric.device)  # place the scale and counters now, so the meter can read them before step 1
    scale.attach(fabric.strategy.precision)  # Fabric's MixedPrecision: its DynamicGradScaler's own counters
    overflow_steps = set(args.overflow_at_step)
    skips = SkippedSteps(plugin.scaler if plugin is not None else None)

    step, batches = 0, iter(loader)
    while step < args.steps:
        try:
            images, labels = next(batches)
        except StopIteration:
            batches = iter(loader)  # a new epoch
            continue
        meter.batch_start(len(images))
        loss = F.cross_entropy(model(images), labels)
        if step + 1 in overflow_steps and fabric.global_rank == 1:  # steps count from 1, as printed
            loss = loss * float("inf")  # one rank's overflow reaches every rank through the gradient all-reduce
        meter.forward_end()
        fabric.backward(loss)  # scaled by the DynamicGradScaler
        optimizer.step()  # unscale, skip on inf/NaN, update the scale: Fabric's plugin calls the scaler
        optimizer.zero_grad(set_to_none=True)
        meter.batch_end(stepped=True)
        scale.step()
        step += 1
        skips.after_step(step)
        if step % args.log_every == 0 or step == args.steps:
            # every rank computes (the efficiency meter gathers one small vector); rank 0 prints
            figures = _prefixed(meter.compute(step=step, final=step == args.steps), scale.compute(step))
            skipped = skips.read()  # one host read per logging step, not per step
            if fabric.is_global_zero:
                print(step_line(step, args.steps, float(loss.detach()), figures, skipped), flush=True)
                if args.json:
                    print("metrics " + json.dumps({"step": step, "loss": float(loss.detach()), **figures}), flush=True)

    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    # torch's own all-gather: Fabric's all_gather goes through a helper torch 2.14 deprecates, and would say so
    local = torch.tensor([checksum], dtype=torch.float64, device=fabric.device)
    checksums = torch.empty(fabric.world_size, dtype=torch.float64, device=fabric.device)
    if fabric.world_size > 1:
        torch.distributed.all_gather_into_tensor(checksums, local)
    else:
        checksums = local
    summary = {
        **_prefixed(meter.summary(), scale.summary()),
        "world_size": fabric.world_size,
        "global_batch_size": args.batch_size * fabric.world_size,
        "flops_per_sample": meter.flops_per_sample,
        "param_checksums": [float(c) for c in checksums.reshape(-1)],
    }
    if fabric.is_global_zero:
        if args.json:
            print("summary " + json.dumps(summary), flush=True)
        from rich.console import Console

        title = f"EfficiencyMeter: {fabric.device.type} x{fabric.world_size}, {args.precision}"
        note = comm_note(f"Fabric's {type(fabric.strategy).__name__}", fabric.world_size, has_comm_stats=False)
        Console(width=100).print(efficiency_table(meter.summary(), title, comm_note=note))
    return summary


class SkippedSteps:
    """Which optimizer steps the scaler skipped, read once per logging step (the counter stays on the device)."""

    def __init__(self, scaler: DynamicGradScaler | None) -> None:
        self.scaler = scaler
        self._counts: list[torch.Tensor] = []  # the cumulative skipped-steps counter after each step of the window
        self._steps: list[int] = []
        self._before = 0

    def after_step(self, step: int) -> None:
        if self.scaler is not None:
            self._counts.append(self.scaler.counter("skipped_steps").clone())  # a device copy: no host sync
            self._steps.append(step)

    def read(self) -> list[int]:
        """The steps skipped since the last read (1-based, as printed)."""
        if not self._counts:
            return []
        counts = [int(c) for c in torch.stack(self._counts).tolist()]
        skipped = [s for s, before, now in zip(self._steps, [self._before, *counts], counts) if now > before]
        self._before, self._counts, self._steps = counts[-1], [], []
        return skipped


def step_line(step: int, steps: int, loss: float, figures: dict[str, float], skipped: list[int]) -> str:
    """One logging step for people: ``step 10/40 | loss 0.4123 | 4,512 samples/s | ... | skipped step 6``."""
    parts = [f"step {step:>{len(str(steps))}}/{steps}", f"loss {loss:.4f}"]
    if "perf/samples_per_sec" in figures:
        parts.append(f"{figures['perf/samples_per_sec']:,.0f} samples/s")
        parts.append(f"step time {figures['perf/step_time_ms']:,.1f} ms")
        parts.append(f"data wait {figures['perf/data_wait_frac']:.1%}")
    else:
        parts.append("warming up (no timing yet)")
    if "amp/loss_scale" in figures:
        parts.append(f"loss scale {figures['amp/loss_scale']:,.0f}")
    if skipped:
        names = ", ".join(map(str, skipped))
        parts.append(f"skipped step{'s' if len(skipped) > 1 else ''} {names} (inf/NaN gradients, weights unchanged)")
    return " | ".join(parts)


def _prefixed(efficiency: dict[str, float], loss_scale: dict[str, float]) -> dict[str, float]:
    """The keys the callbacks log: ``perf/...`` (EfficiencyMonitor) and ``amp/...`` (LossScaleMonitor)."""
    return {**{f"perf/{k}": v for k, v in efficiency.items()}, **{f"amp/{k}": v for k, v in loss_scale.items()}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("devices", "num_nodes", "steps", "batch_size", "hidden", "log_every"):
        value = getattr(args, flag)
        if value < 1:
            print(f"error: --{flag.replace('_', '-')} must be a positive integer, got {value}", file=sys.stderr)
            return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
