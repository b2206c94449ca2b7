"""The private Lightning internals the reliability fixes rely on, through ``lit_accel.utilities._compat``.

``resume_restored_finished_epoch`` works around a Lightning 2.6 resume bug; the first test proves the bug is still
there (when it fails, Lightning fixed it: the workaround may go). The others run the accessor through the same
strategy hook AccelDDP uses, in one process with Lightning's single-device strategy (no process group here).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel.utilities._compat import launched_child_processes
from lit_accel.utilities._workarounds import resume_finished_epoch, resume_loader_states

BATCHES = 4


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.seen.append((self.current_epoch, batch_idx, int(x[0].item())))
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _FixingStrategy(SingleDeviceStrategy):
    """Calls the accessor where AccelDDP does: the first strategy hook after Lightning restored the loops."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.cleared: list[bool] = []

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.cleared.append(resume_finished_epoch(self.lightning_module.trainer))


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(2 * BATCHES).float().unsqueeze(1)), batch_size=2)


def _fit(strategy: Any = "auto", ckpt_path: Path | None = None, callbacks: list | None = None, **kw: Any):
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=bool(callbacks),
        max_steps=3 * BATCHES,
    )
    kwargs.update(kw)
    model = _Recorder()
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, **kwargs)
    trainer.fit(model, _loader(), val_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer, model.seen


def _epoch_end_checkpoint(tmp_path: Path, **kw: Any) -> tuple[Path, list[tuple[int, int, int]]]:
    """A straight run with ``ModelCheckpoint(every_n_epochs=1)``; returns epoch 0's checkpoint and the batches."""
    _, seen = _fit(callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)], **kw)
    return tmp_path / f"epoch=0-step={BATCHES}.ckpt", seen


def test_upstream_still_finished_epoch_resume(tmp_path):
    path, straight = _epoch_end_checkpoint(tmp_path)
    _, resumed = _fit(ckpt_path=path)
    expected = straight[BATCHES:]
    spurious = (0, BATCHES, 0)  # epoch 0, batch index 4 of a 4-batch epoch, data of batch 0
    assert resumed != expected, "Lightning resumes exactly now: the finished_epoch_resume workaround can be narrowed"
    assert resumed[0] == spurious and resumed[1:] == expected[:-1]


@pytest.mark.parametrize("validation", [False, True], ids=["no_validation", "validation"])
def test_accessor_makes_the_epoch_end_resume_exact(tmp_path, validation):
    kw = {"limit_val_batches": 1} if validation else {}
    path, straight = _epoch_end_checkpoint(tmp_path, **kw)
    strategy = _FixingStrategy()
    _, resumed = _fit(strategy, ckpt_path=path, **kw)
    assert strategy.cleared == [True]
    assert resumed == straight[BATCHES:]


def test_accessor_makes_resuming_after_a_fit_stopped_at_an_epoch_end_exact(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` reached ``max_steps`` on an epoch's last batch."""
    _, straight = _fit()
    first, _ = _fit(max_steps=BATCHES)
    first.save_checkpoint(tmp_path / "after_fit.ckpt")
    _, unfixed = _fit(ckpt_path=tmp_path / "after_fit.ckpt")
    assert unfixed[0] == (1, BATCHES, 0)  # Lightning alone: one batch of "epoch 1", index 4, then epoch 2
    strategy = _FixingStrategy()
    _, resumed = _fit(strategy, ckpt_path=tmp_path / "after_fit.ckpt")
    assert strategy.cleared == [True]
    assert resumed == straight[BATCHES:]


def test_accessor_leaves_a_mid_epoch_state_to_lightning(tmp_path):
    _fit(callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)])
    strategy = _FixingStrategy()
    _, resumed = _fit(strategy, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert strategy.cleared == [False]
    assert [(e, b) for e, b, _ in resumed[:2]] == [(0, 2), (0, 3)]  # Lightning continued the epoch


def test_the_restore_order_the_accessor_relies_on():
    # Loops are restored before the optimizers, whose strategy hook is where AccelDDP calls the accessor.
    source = inspect.getsource(_CheckpointConnector.restore_training_state)
    assert source.index("self.restore_loops()") < source.index("self.restore_optimizers_and_schedulers()")
    assert "strategy.load_optimizer_state_dict(" in inspect.getsource(_CheckpointConnector.restore_optimizers)
    # The progress counters and the base-class setter it reads and calls.
    assert isinstance(_Loop.__dict__["restarting"], property) and _Loop.restarting.fset is not None
    loop = pl.Trainer(accelerator="cpu", logger=False).fit_loop
    for tracker in (loop.epoch_progress.current, loop.epoch_loop.batch_progress.current):
        assert {"ready", "started", "processed", "completed"} <= set(vars(tracker))
    assert hasattr(loop.epoch_loop.batch_progress, "is_last_batch")


def test_launched_child_processes_reads_the_popen_launcher():
    strategy = DDPStrategy()
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert launched_child_processes(strategy) == []  # rank 0 before launching: no children yet
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        strategy.launcher.procs = [child]  # what _call_children_scripts assigns
        assert launched_child_processes(strategy) == [(1, child)]
    finally:
        child.wait()
    assert "self.procs.append(" in inspect.getsource(type(strategy.launcher)._call_children_scripts)
    assert launched_child_processes(SingleDeviceStrategy(device=torch.device("cpu"))) == []


class _ResumableLoader(DataLoader):
    """Lightning's ``_Stateful`` protocol: the next iterator skips the batches of the epoch already handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out = self._skip = 0

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0  # read at iter(), as torchdata's StatefulDataLoader does
        self.handed_out = skip
        return self._batches(skip)

    def _batches(self, skip: int) -> Any:
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.handed_out += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["handed_out"]


class _Estimating(_Recorder):
    """Reads ``estimated_stepping_batches`` in ``configure_optimizers``: Lightning sets the train loader up there."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.trainer.estimated_stepping_batches == 3 * BATCHES
        return super().configure_optimizers()


class _LoaderStateStrategy(SingleDeviceStrategy):
    """Calls ``resume_loader_states`` where AccelDDP does, after the loops are restored."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.loaded: list[bool] = []

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.loaded.append(resume_loader_states(self.lightning_module.trainer))


def _fit_resumable(strategy: Any = "auto", ckpt_path: Path | None = None, callbacks: list | None = None):
    model = _Estimating()
    trainer = pl.Trainer(
        strategy=strategy, callbacks=callbacks, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=bool(callbacks), max_epochs=3,
    )  # fmt: skip
    loader = _ResumableLoader(TensorDataset(torch.arange(2 * BATCHES).float().unsqueeze(1)), batch_size=2)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model.seen


def test_upstream_still_loader_states_after_early_setup(tmp_path):
    straight = _fit_resumable(callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=6)])
    resumed = _fit_resumable(ckpt_path=tmp_path / "epoch=1-step=6.ckpt")
    assert resumed != straight[6:], "Lightning loads the loader state now: narrow loader_states_after_early_setup"
    assert resumed[:2] == [(1, 2, 0), (1, 3, 2)]  # the loader restarted epoch 1 at its first sample (0)


def test_resume_loader_states_loads_them_into_a_loader_set_up_early(tmp_path):
    straight = _fit_resumable(callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=6)])
    strategy = _LoaderStateStrategy()
    resumed = _fit_resumable(strategy, ckpt_path=tmp_path / "epoch=1-step=6.ckpt")
    assert strategy.loaded == [True] and resumed == straight[6:]
