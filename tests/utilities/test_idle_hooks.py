"""Lightning skips a callback hook that is not callable: what ``lit_accel.utilities._idle_hooks`` relies on."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lit_accel.utilities._idle_hooks import PER_STEP_HOOKS, idle, idle_unused, wake
from tests.helpers import BNModel


class _Counting(Callback):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def on_train_batch_start(self, *args: Any) -> None:
        self._count("on_train_batch_start")

    def on_before_backward(self, *args: Any) -> None:
        self._count("on_before_backward")


class _Overriding(_Counting):
    def on_before_backward(self, *args: Any) -> None:  # a subclass's own hook is never idled
        self._count("subclass")


def _fit(callbacks: list[Callback], tmp_path: Any) -> None:
    data = TensorDataset(torch.randn(12, 8), torch.randn(12, 4))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=callbacks, default_root_dir=tmp_path,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    trainer.fit(BNModel(), DataLoader(data, batch_size=4))


def test_lightning_skips_idle_hooks_and_calls_them_again_once_woken(tmp_path):
    busy, idled, overriding = _Counting(), _Counting(), _Overriding()
    for callback in (idled, overriding):
        idle(callback, _Counting, "on_before_backward")
    _fit([busy, idled, overriding], tmp_path)
    assert busy.calls == {"on_train_batch_start": 3, "on_before_backward": 3}
    assert idled.calls == {"on_train_batch_start": 3}  # skipped by Lightning's dispatch, no error
    assert overriding.calls == {"on_train_batch_start": 3, "subclass": 3}
    wake(idled, "on_before_backward")
    _fit([idled], tmp_path)
    assert idled.calls == {"on_train_batch_start": 6, "on_before_backward": 3}


def test_idle_unused_leaves_only_the_hooks_a_class_defines():
    callback = _Counting()
    idle_unused(callback)
    idled = {name for name in PER_STEP_HOOKS if getattr(callback, name) is None}
    assert idled == set(PER_STEP_HOOKS) - {"on_train_batch_start", "on_before_backward"}
