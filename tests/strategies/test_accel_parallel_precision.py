"""AccelParallel with AccelPrecision: fp16 loss scaling across stages, bf16, and clipping by the whole model's norm.

fp16 on CPU (real fp16 autocast and a DynamicGradScaler): an inf written into one tensor-parallel shard of one stage's
gradient makes every rank skip that step (parameters unchanged everywhere), the scale backs off identically on all
ranks, the step-interval LR schedule does not move, and the stages that never compute the loss raise nothing.
Clipping: the norm AccelParallel clips by equals one process's (relative 1e-6) on 2-D and 3-D layouts, and the
clipped steps equal one process's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler

from lit_accel import AccelParallel, AccelPrecision, DynamicGradScaler
from tests.helpers import run_distributed
from tests.helpers.models import small_trainer_kwargs
from tests.helpers.parallel import PipeModel, dataset, full
from tests.strategies.test_accel_parallel import assert_equivalent

BAD_STEP = 1
POISONED = "blocks.3.fc1.weight"  # stage 1 of 2, column-wise over the tensor dimension


class _Poison(pl.Callback):
    """Write inf into the local shard of one gradient on one rank at one step; record what every step did."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[dict[str, Any]] = []

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == BAD_STEP and self.rank == 3:  # pipeline 1, tensor 1
            grad = dict(module.named_parameters())[POISONED].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._before = {n: full(p) for n, p in module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        after = {n: full(p) for n, p in module.named_parameters()}
        moved = any(not torch.equal(after[n], self._before[n]) for n in after)
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.steps.append({"scale": trainer.precision_plugin.scaler.get_scale(), "moved": moved, "lr": lr})


class _Scheduled(PipeModel):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fp16_fit(rank: int, world: int, lightning_plugin: bool) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    poison = _Poison(rank)
    strategy = AccelParallel(pipeline_parallel=2, tensor_parallel=2)
    if lightning_plugin:  # torch's GradScaler: its scale is created lazily, by scale(), which only the last stage calls
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    else:
        plugin = AccelPrecision("16-mixed", device="cpu", scaler=DynamicGradScaler(init_scale=2.0**10))
    trainer = pl.Trainer(strategy=strategy, plugins=[plugin], callbacks=[poison],
                         **small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1))  # fmt: skip
    trainer.fit(_Scheduled(), DataLoader(dataset(48), batch_size=8))
    return poison.steps


@pytest.mark.parametrize("lightning_plugin", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fp16_inf_in_one_tensor_shard_of_one_stage_skips_the_step_everywhere(lightning_plugin):
    steps = run_distributed(_fp16_fit, 4, lightning_plugin, init_process_group=False, timeout=300)
    for rank_steps in steps:
        assert [s["moved"] for s in rank_steps] == [True, False, True]
        assert [s["scale"] for s in rank_steps] == [2.0**10, 2.0**9, 2.0**9]
        if not lightning_plugin:  # AccelPrecision's skip-aware schedulers: the skipped step left the schedule alone
            assert [s["lr"] for s in rank_steps] == [0.025, 0.025, 0.0125]
    assert all(rank_steps == steps[0] for rank_steps in steps)


def _bf16_fit(rank: int, world: int) -> float:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=2), plugins=[AccelPrecision("bf16-mixed")],
                         **small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1))  # fmt: skip
    model = PipeModel()
    trainer.fit(model, DataLoader(dataset(48), batch_size=8))
    return float(trainer.callback_metrics.get("train_loss", torch.tensor(0.0)))


def test_bf16_trains_through_the_pipeline():
    run_distributed(_bf16_fit, 4, init_process_group=False, timeout=300)


# ---------------------------------------------------------------------------------------------------- clipping


class _Norms(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        # AccelParallel: the norm it clipped by; one process: the norm Lightning's clip_grad_norm_ is about to see.
        norm = getattr(trainer.strategy, "last_grad_norm", None)
        if norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])
        self.norms.append(float(norm))


def _clip_fit(rank: int, world: int, strategy_kwargs: dict[str, Any]) -> list[float]:

    pl.seed_everything(0, verbose=False)
    norms = _Norms()
    strategy = AccelParallel(**strategy_kwargs)
    layout = strategy.plan.for_world("t", world).layout
    sampler = DistributedSampler(dataset(64), layout.data, layout.data_rank(rank), shuffle=False)
    trainer = pl.Trainer(strategy=strategy, callbacks=[norms], gradient_clip_val=0.5, use_distributed_sampler=False,
                         **small_trainer_kwargs(devices=world, max_steps=3, max_epochs=-1))  # fmt: skip
    trainer.fit(PipeModel(), DataLoader(dataset(64), batch_size=8, sampler=sampler))
    return norms.norms


def _reference_norms(global_batch: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    norms = _Norms()
    trainer = pl.Trainer(callbacks=[norms], gradient_clip_val=0.5,
                         **small_trainer_kwargs(max_steps=3, max_epochs=-1))  # fmt: skip
    trainer.fit(PipeModel(), DataLoader(dataset(64), batch_size=global_batch))
    return norms.norms


CLIP_LAYOUTS = {
    "dp2xtp2": ({"tensor_parallel": 2}, 4, 16),
    "pp2xtp2": ({"pipeline_parallel": 2, "tensor_parallel": 2}, 4, 8),
    "pp2xdp2xtp2": ({"pipeline_parallel": 2, "tensor_parallel": 2}, 8, 16),
}


@pytest.mark.parametrize("layout", ["pp2xtp2", pytest.param("dp2xtp2", marks=pytest.mark.slow),
                                    pytest.param("pp2xdp2xtp2", marks=pytest.mark.slow)])  # fmt: skip
def test_clipping_uses_the_whole_models_norm(layout):
    strategy_kwargs, world, global_batch = CLIP_LAYOUTS[layout]
    want = _reference_norms(global_batch)
    got = run_distributed(_clip_fit, world, strategy_kwargs, init_process_group=False, timeout=300)
    assert want[0] > 0.5  # the norm is above the threshold: every step clips
    for rank_norms in got:
        assert rank_norms == pytest.approx(want, rel=1e-6)


@pytest.mark.slow
def test_clipped_steps_equal_one_process():
    assert_equivalent(
        {"pipeline_parallel": 2, "tensor_parallel": 2}, world=4, loaded=8, compare_grads=False, gradient_clip_val=0.5
    )
