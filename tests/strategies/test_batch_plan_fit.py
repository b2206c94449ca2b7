"""The batch plan in real fits: resolved before ``configure_optimizers``, so the stepping estimate is the truth.

Each case builds a OneCycleLR from ``trainer.estimated_stepping_batches`` inside ``configure_optimizers`` (Lightning's
documented pattern). OneCycleLR raises when stepped more often than that, and a run that stepped less would never
anneal: the fit must complete, the estimate must equal the optimizer steps taken, and the plan is printed once.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_accel import AccelDDP, AccelFSDP, BatchPlan
from tests.helpers import BNModel, lightning_info_messages, make_dataset, run_distributed, small_trainer_kwargs


class OneCycle(BNModel):
    """BNModel (no BatchNorm) stepping a OneCycleLR sized by ``estimated_stepping_batches``."""

    def __init__(self) -> None:
        super().__init__(batchnorm=False)
        self.estimate: int | None = None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        self.estimate = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.estimate)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Data(pl.LightningDataModule):
    def __init__(self, samples: int, batch: int) -> None:
        super().__init__()
        self.samples, self.batch = samples, batch

    def setup(self, stage: str) -> None:
        self.dataset = make_dataset(self.samples)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch)


def _fit(devices: int, strategy: Any, loader_batch: int, samples: int, datamodule: bool, **trainer: Any) -> dict:
    pl.seed_everything(0, verbose=False)
    model = OneCycle()
    kwargs = small_trainer_kwargs(devices=devices, max_steps=-1, max_epochs=1)
    kwargs.update(trainer)
    fit = pl.Trainer(strategy=strategy, **kwargs)
    data = Data(samples, loader_batch)
    with lightning_info_messages() as messages:
        if datamodule:
            fit.fit(model, datamodule=data)
        else:
            data.setup("fit")
            fit.fit(model, data.train_dataloader())
    name = type(strategy).__name__
    return {
        "estimate": model.estimate,
        "steps": fit.global_step,
        "plan_lines": [m for m in messages if m.startswith(f"{name}: global batch")],
        "plan": strategy.batch_plan,
        "accumulation": fit.accumulate_grad_batches,
    }


# name -> (devices, strategy factory, loader batch, samples, trainer arguments, expected steps, expected plan)
CASES: dict[str, tuple[int, Any, int, int, dict[str, Any], int, BatchPlan]] = {
    "ddp1": (1, lambda: AccelDDP(global_batch_size=64, micro_batch_size=8), 32, 256, {}, 4,
             BatchPlan(64, 32, 8, 4, 2, 1)),
    "ddp1_max_steps": (1, lambda: AccelDDP(global_batch_size=64, micro_batch_size=8), 32, 256, {"max_steps": 3}, 3,
                       BatchPlan(64, 32, 8, 4, 2, 1)),
    # 5 loaded batches per epoch, 2 per step: windows of 2, 2, 1 -> 3 steps per epoch
    "ddp1_limit": (1, lambda: AccelDDP(global_batch_size=64), 32, 256, {"limit_train_batches": 5, "max_epochs": 2},
                   6, BatchPlan(64, 32, 32, 1, 2, 1)),
    "ddp2_micro": (2, lambda: AccelDDP(global_batch_size=64, micro_batch_size=16), 32, 512, {}, 8,
                   BatchPlan(64, 32, 16, 2, 1, 2)),
    "ddp2": (2, lambda: AccelDDP(global_batch_size=64), 16, 256, {}, 4, BatchPlan(64, 16, 16, 1, 2, 2)),
    "ddp2_limit": (2, lambda: AccelDDP(global_batch_size=64), 16, 256, {"limit_train_batches": 3, "max_epochs": 2},
                   4, BatchPlan(64, 16, 16, 1, 2, 2)),
    "ddp2_reload": (2, lambda: AccelDDP(global_batch_size=64), 16, 256,
                    {"reload_dataloaders_every_n_epochs": 1, "max_epochs": 2, "datamodule": True}, 8,
                    BatchPlan(64, 16, 16, 1, 2, 2)),
    "fsdp2": (2, lambda: AccelFSDP(global_batch_size=32, micro_batch_size=8), 16, 256, {}, 8,
              BatchPlan(32, 16, 8, 2, 1, 2)),
    "fsdp2_max_steps": (2, lambda: AccelFSDP(global_batch_size=32, micro_batch_size=8), 16, 256, {"max_steps": 5},
                        5, BatchPlan(32, 16, 8, 2, 1, 2)),
    "fsdp2_datamodule": (2, lambda: AccelFSDP(global_batch_size=64), 16, 256,
                         {"datamodule": True, "limit_train_batches": 7}, 4, BatchPlan(64, 16, 16, 1, 2, 2)),
}  # fmt: skip


def _cases(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, (devices, make, batch, samples, trainer, _, _) in CASES.items():
        if devices == world:
            trainer = dict(trainer)
            results[name] = _fit(devices, make(), batch, samples, trainer.pop("datamodule", False), **trainer)
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_the_stepping_estimate_in_configure_optimizers_is_the_number_of_steps_taken(world):
    # spawned: a forked child can deadlock in a matmul on the OpenMP pool of a parent that trained in-process before
    runs = run_distributed(_cases, world, init_process_group=False, timeout=240, start_method="spawn")
    for rank, results in enumerate(runs):
        for name, result in results.items():
            _, _, _, _, _, steps, plan = CASES[name]
            assert (result["estimate"], result["steps"]) == (steps, steps), name
            assert result["plan"] == plan and result["accumulation"] == plan.accumulate_grad_batches, name
            assert len(result["plan_lines"]) == (1 if rank == 0 else 0), (name, result["plan_lines"])
            if rank == 0:
                assert result["plan_lines"][0].endswith(plan.describe()), name


class _Batches(IterableDataset):
    """Yields whole batches (the loader's batch_size is None): no batch size to plan with before training."""

    def __iter__(self) -> Any:
        dataset = make_dataset(64)
        for start in range(0, 64, 16):
            yield dataset[start : start + 16]


def _unplannable(rank: int, world: int) -> tuple[str, int | None]:
    model = OneCycle()
    trainer = pl.Trainer(strategy=AccelDDP(global_batch_size=64), **small_trainer_kwargs(max_steps=-1, max_epochs=1))
    with pytest.raises(ValueError) as info:
        trainer.fit(model, DataLoader(_Batches(), batch_size=None))
    return str(info.value), model.estimate


def test_a_loader_without_batch_size_is_named_before_training():
    message, estimate = run_distributed(_unplannable, 1, init_process_group=False, timeout=60)[0]
    assert message.startswith("AccelDDP(global_batch_size=64): the train dataloader has no batch_size"), message
    assert "Fix: give the DataLoader a batch_size" in message
    assert estimate is None  # configure_optimizers never ran


class _GrowingData(Data):
    """A datamodule whose reloaded train dataloader doubles its batch size."""

    def train_dataloader(self) -> DataLoader:
        loader = DataLoader(self.dataset, batch_size=self.batch)
        self.batch *= 2
        return loader


def _reloads_bigger(rank: int, world: int) -> tuple[str, int]:
    model = OneCycle()
    kwargs = small_trainer_kwargs(max_steps=-1, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    trainer = pl.Trainer(strategy=AccelDDP(global_batch_size=64), **kwargs)
    with pytest.raises(ValueError) as info:
        trainer.fit(model, datamodule=_GrowingData(256, 32))
    return str(info.value), trainer.global_step


def test_a_reloaded_loader_that_changes_the_plan_is_refused_at_the_reload():
    message, steps = run_distributed(_reloads_bigger, 1, init_process_group=False, timeout=120, start_method="spawn")[0]
    assert "reloaded train dataloader's batch_size=64 changes the plan (global batch 64 = 32 loaded" in message
    assert "Fix: keep batch_size=32 when reloading" in message and steps == 4  # epoch 0 ran, epoch 1 did not start
