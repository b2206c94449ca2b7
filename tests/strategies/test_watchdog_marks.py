"""lit_accel's strategies mark the start of each HangWatchdog batch themselves, exactly as its callback hook would.

The strategy that adds the watchdog marks a batch's start from its own ``training_step``, so Lightning's dispatch
leaves out that callback hook per batch (``benchmarks/host_cost.py``); the end stays with ``on_train_batch_end``,
after the other callbacks' (a checkpoint saved there). Proven by equality: the sequence of phases, steps and
allowances the watchdog records under ``AccelDDP`` equals the one its hooks record under Lightning's own strategy,
for automatic optimization with and without accumulation (a partial last window), micro-batches, manual optimization
and a checkpoint saved at the end of a batch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from lit_accel import AccelDDP
from lit_accel.callbacks.hang_watchdog import HangWatchdog
from tests.helpers.models import BNModel, make_dataset, make_loader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Manual(BNModel):
    def __init__(self) -> None:
        super().__init__(batchnorm=False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class _Marks(HangWatchdog):
    """A HangWatchdog that records every phase it enters, and which of its per-batch hooks Lightning skipped."""

    def __init__(self) -> None:
        super().__init__(7.0, first_step_timeout=70.0, validation_timeout=700.0, on_hang="report")
        self.marks: list[tuple[str, int | None, float]] = []
        self.idle_in_fit: bool | None = None
        enter = self.watchdog.enter

        def recording(phase: str, step: int | None = None, allowance: float | None = None) -> None:
            self.marks.append((phase, step, allowance))
            enter(phase, step, allowance)

        self.watchdog.enter = recording  # type: ignore[method-assign]

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.idle_in_fit = self.__dict__.get("on_train_batch_start", "awake") is None


def _fit(strategy: Any, module: pl.LightningModule, checkpoint_dir: Any = None, **kwargs: Any) -> _Marks:
    watchdog = _Marks()
    saving = [] if checkpoint_dir is None else [ModelCheckpoint(checkpoint_dir, every_n_train_steps=2, save_top_k=-1)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[*saving, watchdog],
        max_epochs=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, make_loader(make_dataset(20), 4), make_loader(make_dataset(8), 4))  # 5 batches an epoch
    return watchdog


CASES = {
    "automatic": ({}, {}, BNModel),
    "accumulation_with_a_partial_window": ({}, {"accumulate_grad_batches": 2}, BNModel),
    "micro_batches": ({"micro_batch_size": 2}, {"accumulate_grad_batches": 2}, BNModel),
    "manual": ({}, {}, _Manual),
    "checkpoint_at_a_batch_end": ({}, {"checkpoint_dir": True}, BNModel),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_strategy_marks_the_phases_its_hooks_would(case, tmp_path):
    accel_kwargs, trainer_kwargs, model = CASES[case]
    if "checkpoint_dir" in trainer_kwargs:
        trainer_kwargs = {"checkpoint_dir": tmp_path}
    torch.manual_seed(0)
    hooks = _fit(SingleDeviceStrategy("cpu"), model(), **trainer_kwargs)
    torch.manual_seed(0)
    ours = _fit(AccelDDP(**accel_kwargs), model(), **trainer_kwargs)
    assert hooks.idle_in_fit is False and ours.idle_in_fit is True  # Lightning dispatched no per-batch hook of ours
    batches = [m for m in hooks.marks if m[0] == "training_step"]
    assert len(batches) == 10, hooks.marks  # 5 batches x 2 epochs, each marked
    assert ours.marks == hooks.marks
    assert ours.marks[1] == ("training_step", 0, 70.0) and ("data", 1, 7.0) in ours.marks  # first step, then later
    if case == "checkpoint_at_a_batch_end":
        assert ("checkpoint", 2, 600.0) in ours.marks  # the saves were marked, in the hooks' order
    assert "on_train_batch_start" not in ours.__dict__  # the hook is back for the next fit's strategy


def test_a_subclass_that_overrides_the_batch_start_hook_keeps_it_and_is_not_marked():
    calls: list[int] = []

    class Own(_Marks):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            calls.append(trainer.global_step)
            super().on_train_batch_start(trainer, *args)

    watchdog = Own()
    assert not watchdog.mark_steps() and "on_train_batch_start" not in watchdog.__dict__
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AccelDDP(), callbacks=[watchdog], max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(BNModel(), make_loader(make_dataset(20), 4))
    assert calls == [0, 1, 2]
    assert [m[:2] for m in watchdog.marks if m[0] != "setup"] == [
        ("training_step", 0), ("data", 1), ("training_step", 1), ("data", 2), ("training_step", 2), ("data", 3)
    ]  # fmt: skip
