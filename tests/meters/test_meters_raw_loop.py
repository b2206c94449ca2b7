"""The meters without Lightning: a raw PyTorch DDP loop on 2 gloo processes gets the callbacks' figures.

Both runs advance one fake clock by the same amounts at the same points (data, forward, backward), train the same
model on the same data with the same fp16 scaler (an overflow injected at one step), and count the same all-reduces;
so every figure that does not depend on real time must be equal, window by window.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lit_accel import (
    AccelDDP,
    AccelPrecision,
    DynamicGradScaler,
    EfficiencyMeter,
    EfficiencyMonitor,
    LossScaleMeter,
    LossScaleMonitor,
)
from lit_accel.strategies.ddp._comm_hooks import counting_comm_hook
from lit_accel.strategies.parts._comm_stats import HookCommStats
from tests.helpers import BNModel, make_dataset, make_loader, run_distributed, small_trainer_kwargs

DATA, FORWARD, BACKWARD = 0.25, 0.5, 0.25
STEPS, EVERY, BATCH, OVERFLOW_AT = 6, 2, 4, 2
FLOPS, PEAK = 1000.0, 1e6
# Real-time figures (the all-reduce's measured duration) are left out; everything else must agree.
COMPARED = {
    "samples_per_sec",
    "samples_per_sec_per_device",
    "step_time_ms",
    "data_wait_frac",
    "tflops_per_device",
    "mfu",
    "step_time_spread",
    "comm_gb_per_step",
}


class _Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


class _Timed(BNModel):
    def __init__(self, clock: _Clock) -> None:
        super().__init__(batchnorm=False)
        self.clock = clock

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.clock.now += DATA
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += FORWARD
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step == OVERFLOW_AT else loss

    def on_after_backward(self) -> None:
        self.clock.now += BACKWARD


def _lightning_run(rank: int, world_size: int) -> dict[str, Any]:
    clock = _Clock()
    pl.seed_everything(0, verbose=False)
    model = _Timed(clock)
    efficiency = EfficiencyMonitor(warmup_steps=1, flops_per_sample=FLOPS, peak_flops=PEAK, clock=clock)
    scale = LossScaleMonitor(logging_interval=EVERY)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            max_steps=STEPS,
            log_every_n_steps=EVERY,
            use_distributed_sampler=False,
            strategy=AccelDDP(sync_batchnorm=False, comm_hook=default_hooks.allreduce_hook),
            plugins=[AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=2))],
            callbacks=[efficiency, scale],
        )
    )
    seen: list[dict[str, float]] = []
    original = scale.meter.compute
    scale.meter.compute = lambda step: (seen.append(original(step)), seen[-1])[1]  # type: ignore[method-assign]
    trainer.fit(model, make_loader(make_dataset(64), BATCH, rank, world_size))
    return {"windows": efficiency.meter.windows, "scale": seen, "summary": efficiency.summary}


def _raw_run(rank: int, world_size: int) -> dict[str, Any]:
    clock = _Clock()
    pl.seed_everything(0, verbose=False)
    module = BNModel(batchnorm=False)
    optimizer = module.configure_optimizers()
    ddp = DistributedDataParallel(module)
    stats = HookCommStats()
    ddp.register_comm_hook(None, counting_comm_hook(default_hooks.allreduce_hook, "allreduce", stats))
    scaler = DynamicGradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    meter = EfficiencyMeter(
        "cpu", warmup_steps=1, flops_per_sample=FLOPS, peak_flops=PEAK, comm_stats=stats, clock=clock
    )
    scale_meter = LossScaleMeter()
    scale_meter.attach(scaler)
    scale_values = []
    for step, (x, y) in enumerate(make_loader(make_dataset(64), BATCH, rank, world_size)):
        if step == STEPS:
            break
        clock.now += DATA
        meter.batch_start(len(x))
        clock.now += FORWARD
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        loss = loss * float("inf") if step == OVERFLOW_AT else loss
        meter.forward_end()
        scaler.scale(loss).backward()
        clock.now += BACKWARD
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        meter.batch_end(stepped=True)
        scale_meter.step()
        if (step + 1) % EVERY == 0:
            meter.compute(step=step)
            scale_values.append(scale_meter.compute(step + 1))
    meter.compute(step=STEPS - 1, final=True)
    assert dist.get_world_size() == world_size
    return {"windows": meter.windows, "scale": scale_values, "summary": meter.summary()}


def _both(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _lightning_run(rank, world_size), _raw_run(rank, world_size)


def test_a_raw_ddp_loop_gets_the_callbacks_figures():
    for lightning, raw in run_distributed(_both, 2, timeout=180):
        assert len(lightning["windows"]) == len(raw["windows"]) >= 2
        for ours, theirs in zip(raw["windows"], lightning["windows"]):
            assert set(ours) >= COMPARED, ours
            assert {k: ours.get(k) for k in COMPARED} == {k: theirs.get(k) for k in COMPARED}
        assert raw["windows"][0]["step_time_ms"] == 1000.0 * (DATA + FORWARD + BACKWARD)
        assert raw["windows"][0]["comm_gb_per_step"] > 0
        assert {k: raw["summary"][k] for k in COMPARED if k in raw["summary"]} == {
            k: lightning["summary"][k] for k in COMPARED if k in raw["summary"]
        }
        # Loss scaling: the overflow at step 2 skips once and halves the scale; the meters agree at every log.
        assert raw["scale"] == lightning["scale"] and len(raw["scale"]) == STEPS // EVERY
        assert raw["scale"][1]["skipped_steps"] == 1 and raw["scale"][1]["scale_backoffs"] == 1
