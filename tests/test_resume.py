"""Issue #10, resume: a run checkpointed and resumed continues exactly as the uninterrupted run.

One 2-process AccelDDP job (real gloo ranks) trains 9 optimizer steps straight with fp16 AccelPrecision (hysteresis,
growth, injected overflows), AccelDDP's global batch (accumulation 2 with a partial last window every epoch),
SyncBatchNorm, AdamW, a step-interval StepLR and both monitors, saving checkpoints at an epoch end and mid-epoch.
Fresh Trainers then resume from each checkpoint to the same 9 steps. Every resumed run must train on exactly the
batches the straight run trained on after that checkpoint and end with bit-identical weights (``torch.equal``),
optimizer, scheduler and scaler state and identical monitor state. Checkpoints are loaded with ``weights_only=True``.

Mid-epoch resume needs a resumable loader (Lightning's ``_Stateful`` protocol: ``state_dict``/``load_state_dict``);
a plain ``DataLoader`` restarts the epoch's data from its first batch, which the control run shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_accel import AccelDDP, AccelPrecision, DynamicGradScaler, EfficiencyMonitor, LossScaleMonitor
from tests.helpers import BNModel, params_of, run_distributed, small_trainer_kwargs

WORLD_SIZE = 2
MICRO_BATCH = 4
BATCHES_PER_EPOCH = 5  # per rank: windows of 2, 2 and 1 micro-batches with accumulation 2
GLOBAL_BATCH = MICRO_BATCH * 2 * WORLD_SIZE  # accumulation 2
STEPS_PER_EPOCH = 3
MAX_STEPS = 3 * STEPS_PER_EPOCH
# Optimizer steps whose loss is inf on rank 1 only (the all-reduce carries the inf to rank 0): with hysteresis 2 the
# overflow at step 2 (the last of epoch 0) is still pending at the epoch-end checkpoint, so only a restored streak
# backs off at step 3; step 7 is a lone overflow after the mid-epoch checkpoint.
OVERFLOW_STEPS = (2, 3, 7)
EPOCH_END_CKPT = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"  # saved at on_train_epoch_end of epoch 0
MID_EPOCH_CKPT = "epoch=1-step=4.ckpt"  # saved at on_train_batch_end of epoch 1, batch 1: an optimizer step


class _ResumableLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch: it implements Lightning's ``_Stateful`` protocol.

    ``state_dict`` records how many batches of the current epoch were handed out; after ``load_state_dict`` the next
    iterator skips that many (none if the epoch had finished). Lightning's fetcher does not prefetch from a loader
    with a length, so at a checkpoint the count equals the batches trained on. The iterator is a generator, so the
    sampler is only iterated at the first ``next()``, after Lightning has called ``set_epoch`` for the resumed epoch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_yielded = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self.batches_yielded = 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.batches_yielded = index + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self.batches_yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        done = state_dict["batches_yielded"]
        self._skip = done if done < len(self) else 0  # a finished epoch resumes at the start of the next one


class _Model(BNModel):
    """BNModel (Linear, BatchNorm, ReLU, Linear) on ``(x, y, sample id)`` batches with AdamW and a step StepLR."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw", lr=0.01)
        self.seen: list[tuple[int, int, tuple[int, ...], int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.append((self.current_epoch, batch_idx, tuple(ids.tolist()), self.global_step))
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.global_step in OVERFLOW_STEPS and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _CountSteps(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches += 1


def _loader(rank: int, resumable: bool) -> DataLoader:
    n = MICRO_BATCH * BATCHES_PER_EPOCH * WORLD_SIZE
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g), torch.arange(n))
    sampler = DistributedSampler(data, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=1)
    cls = _ResumableLoader if resumable else DataLoader
    return cls(data, batch_size=MICRO_BATCH, sampler=sampler)


def _fit(rank: int, tmp: Path, ckpt_path: Path | None = None, resumable: bool = True) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = _Model()
    precision = AccelPrecision(
        "16-mixed", scaler=DynamicGradScaler(init_scale=2.0**10, hysteresis=2, growth_interval=2)
    )
    loss_scale = LossScaleMonitor(logging_interval=1)
    efficiency = EfficiencyMonitor(warmup_steps=1, peak_flops=1e12, print_summary=False)
    counter = _CountSteps()
    callbacks: list[Callback] = [loss_scale, efficiency, counter]
    if ckpt_path is None:  # the straight run writes the checkpoints
        callbacks.append(ModelCheckpoint(dirpath=tmp / "epochs", save_top_k=-1, every_n_epochs=1))
        callbacks.append(ModelCheckpoint(dirpath=tmp / "steps", save_top_k=-1, every_n_train_steps=4))
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=WORLD_SIZE,
            strategy=AccelDDP(global_batch_size=GLOBAL_BATCH),
            plugins=[precision],
            callbacks=callbacks,
            max_steps=MAX_STEPS,
            use_distributed_sampler=False,
            enable_checkpointing=ckpt_path is None,
        )
    )
    trainer.fit(model, _loader(rank, resumable), ckpt_path=ckpt_path, weights_only=True)
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    return {
        "seen": model.seen,
        "batches_run": counter.batches,
        "params": params_of(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "loss_scale_state": loss_scale.state_dict(),
        "loss_scale_metrics": loss_scale.last_metrics,
        "flops_per_sample": efficiency.flops_per_sample,
        "efficiency_config": {k: v for k, v in efficiency.report["config"].items()},
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "accumulation": trainer.accumulate_grad_batches,
    }


def _without_loader_state(tmp: Path) -> Path:
    """The mid-epoch checkpoint as a plain ``DataLoader`` run would have written it: no loader state."""
    path = tmp / "steps" / "no_loader_state.ckpt"
    if torch.distributed.get_rank() == 0:
        checkpoint = torch.load(tmp / "steps" / MID_EPOCH_CKPT, weights_only=True)
        del checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        torch.save(checkpoint, path)
    torch.distributed.barrier()
    return path


def _resume_runs(rank: int, world_size: int, tmp: Path) -> dict[str, dict[str, Any]]:
    straight = _fit(rank, tmp)
    return {
        "straight": straight,
        "epoch_end": _fit(rank, tmp, tmp / "epochs" / EPOCH_END_CKPT),
        "mid_epoch": _fit(rank, tmp, tmp / "steps" / MID_EPOCH_CKPT),
        "mid_epoch_plain_loader": _fit(rank, tmp, _without_loader_state(tmp), resumable=False),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("resume")
    return run_distributed(_resume_runs, WORLD_SIZE, tmp, init_process_group=False, timeout=180)


def _equal(a: Any, b: Any) -> bool:
    """Exact equality of nested state: tensors with ``torch.equal``, the rest with ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _after(seen: list[tuple[int, int, tuple[int, ...], int]], epoch: int, batch_idx: int) -> list[Any]:
    """The straight run's batches after ``(epoch, batch_idx)``."""
    index = next(i for i, (e, b, _, _) in enumerate(seen) if (e, b) == (epoch, batch_idx))
    return seen[index + 1 :]


def test_straight_run_exercises_what_the_resume_must_restore(runs):
    """The reference run covers every piece of state: back-off after a streak across the epoch end, growth, a
    pending growth tracker at the mid-epoch checkpoint, partial windows, and the scheduler stepping."""
    for rank_runs in runs:
        straight = rank_runs["straight"]
        assert straight["accumulation"] == 2 and straight["global_step"] == MAX_STEPS
        assert straight["batches_run"] == 3 * BATCHES_PER_EPOCH
        scaler = straight["precision"]  # the scaler's entries, under torch's keys
        # steps 0-1 clean: growth to 2**11; 2, 3 overflow: back-off at the second; 4-5 clean: growth; 7 overflows
        assert (scaler["skipped_steps"], scaler["backoffs"], scaler["growths"]) == (3, 1, 2)
        assert scaler["scale"] == 2.0**11 and scaler["overflow_streak"] == 0 and scaler["_growth_tracker"] == 1
        assert straight["loss_scale_metrics"]["amp/skipped_steps"] == 3
    assert _equal(runs[0]["straight"]["params"], runs[1]["straight"]["params"])  # DDP keeps the ranks identical


@pytest.mark.parametrize(
    ("run", "epoch", "batch_idx"),
    [("epoch_end", 0, BATCHES_PER_EPOCH - 1), ("mid_epoch", 1, 1)],
    ids=["epoch_end", "mid_epoch"],
)
def test_resume_continues_exactly_as_the_straight_run(runs, run, epoch, batch_idx):
    for rank_runs in runs:
        straight, resumed = rank_runs["straight"], rank_runs[run]
        # The same batches (epoch, index, sample ids, step) as the straight run after the checkpoint: no spurious
        # replayed batch at the epoch boundary, no restarted epoch mid-way.
        assert resumed["seen"] == _after(straight["seen"], epoch, batch_idx)
        assert resumed["batches_run"] == len(resumed["seen"])
        for key in ("global_step", "current_epoch"):
            assert resumed[key] == straight[key]
        # fp32 weights and BatchNorm buffers bit-identical; optimizer, scheduler and scaler state identical.
        assert _equal(resumed["params"], straight["params"])
        assert _equal(resumed["optimizer"], straight["optimizer"])
        assert resumed["scheduler"] == straight["scheduler"]
        assert resumed["precision"] == straight["precision"]  # scale, growth tracker, streak, skipped, growths, ...
        # LossScaleMonitor: counters, minimum scale and windows restored, so the last logged values agree too.
        assert resumed["loss_scale_state"] == straight["loss_scale_state"]
        assert resumed["loss_scale_metrics"] == straight["loss_scale_metrics"]
        # EfficiencyMonitor keeps no state across a resume: its settings come from the constructor and FLOPs per
        # sample are counted again on the first resumed step, giving the same number; timings start afresh.
        assert resumed["flops_per_sample"] == straight["flops_per_sample"] > 0
        assert resumed["efficiency_config"] == straight["efficiency_config"]


def test_mid_epoch_resume_with_a_plain_loader_restarts_the_epoch_data(runs):
    """Control: without the loader's state Lightning continues at batch index 2 but with the epoch's first data."""
    for rank_runs in runs:
        expected = _after(rank_runs["straight"]["seen"], 1, 1)
        plain = rank_runs["mid_epoch_plain_loader"]["seen"]
        assert [(e, b) for e, b, _, _ in plain] == [(e, b) for e, b, _, _ in expected]
        assert plain[0][2] != expected[0][2]  # but not the same samples
        assert not _equal(rank_runs["mid_epoch_plain_loader"]["params"], rank_runs["straight"]["params"])
