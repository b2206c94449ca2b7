"""What users look at first: a line per epoch on the console, and the training curves in ``training.png``.

:class:`TrainingReport` reads what the LightningModule logs (``train/loss``, its epoch mean ``train/loss_epoch``,
``val/acc``, ``val/loss``) and the optimizer's learning rate, at logging steps and validations only (no per-step host
sync). Its history is saved in every checkpoint, so a resumed run's curves continue the interrupted run's. At the end
of fit rank 0 writes ``training.json`` (the series, ``{"steps": [...], "validations": [...]}``) and ``training.png``
drawn from it, beside the run's other reports.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.data import extract_batch_size

from lit_accel.meters.plots import save_png

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TrainingReport", "epoch_line", "training_figure"]

_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}


def epoch_line(row: dict[str, Any]) -> str:
    """One epoch as timm prints it: ``epoch 3/30 | train loss 0.4123 | val top-1 93.06% | lr 1.92e-03 | ...``."""

    def part(name: str, key: str, spec: str, unit: str = "") -> str:
        value = row.get(key)
        return f"{name} {'n/a' if value is None else format(value, spec) + unit}"

    epoch = f"epoch {row['epoch'] + 1}/{row['epochs']}" if row.get("epochs") else f"epoch {row['epoch'] + 1}"
    if row.get("resumed_at_batch"):
        epoch += f" (resumed at batch {row['resumed_at_batch']})"
    parts = [
        epoch,
        f"step {row['step']}",
        part("train loss", "train_loss", ".4f"),
        part("val top-1", "val_acc", ".2%"),
        part("lr", "lr", ".2e"),
        part("samples/s", "samples_per_sec", ",.0f"),
    ]
    return " | ".join(parts)


def training_figure(history: dict[str, Any], title: str) -> Figure:
    """Training loss (and validation loss), validation top-1 and the learning rate over optimizer steps.

    With ``steps_per_epoch`` in ``history`` the top axis counts epochs too.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9.0, 8.0), layout="constrained")
    FigureCanvasAgg(figure)
    loss, accuracy, lr = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title)
    steps, validations = history.get("steps", []), history.get("validations", [])

    def series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        kept = [r for r in rows if r.get(key) is not None]
        return [r["step"] for r in kept], [r[key] * scale for r in kept]

    loss.plot(*series(steps, "train_loss"), marker=".", color="tab:blue", label="training loss")
    if any(v.get("val_loss") is not None for v in validations):
        loss.plot(*series(validations, "val_loss"), marker="o", color="tab:orange", label="validation loss")
    loss.set_ylabel("cross-entropy")
    loss.set_ylim(bottom=0.0)
    accuracy.plot(*series(validations, "val_acc", 100.0), marker="o", color="tab:green", label="validation top-1")
    accuracy.set_ylabel("top-1 (%)")
    accuracy.set_ylim(0.0, 100.0)
    lr.plot(*series(steps, "lr"), marker=".", color="tab:purple", label="learning rate")
    lr.set_ylabel("learning rate")
    lr.set_ylim(bottom=0.0)
    lr.set_xlabel("optimizer step")
    lr.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (loss, accuracy, lr):
        axes.legend(**_LEGEND)
    per_epoch = history.get("steps_per_epoch")
    if per_epoch:
        top = loss.secondary_xaxis("top", functions=(lambda s: s / per_epoch, lambda e: e * per_epoch))
        top.set_xlabel("epoch")
    return figure


class TrainingReport(Callback):
    """A line per epoch on the console (rank 0) and ``training.png``/``training.json`` in ``output_dir`` after fit.

    Args:
        output_dir: where the picture and its data go (``None``: console only).
        print_epochs: print the per-epoch line.
    """

    def __init__(self, output_dir: str | Path | None = None, print_epochs: bool = True) -> None:
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.print_epochs = print_epochs
        self.history: dict[str, Any] = {"steps": [], "validations": []}
        self._epoch: dict[str, Any] = {}
        self._clock: float | None = None
        self._step_at_batch_start = 0

    # ------------------------------------------------------------------ history, saved in checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = state_dict["history"]

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = trainer.num_training_batches
        if isinstance(batches, int) and batches > 0:
            self.history["steps_per_epoch"] = batches / max(1, trainer.accumulate_grad_batches)
        self._new_epoch(trainer, resumed=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch.get("epoch") != trainer.current_epoch or self._epoch.get("samples"):
            self._new_epoch(trainer, resumed=False)

    def _new_epoch(self, trainer: pl.Trainer, resumed: bool) -> None:
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready if resumed else 0
        self._epoch = {"epoch": trainer.current_epoch, "samples": 0.0, "train_s": 0.0, "resumed_at_batch": done}
        self._clock = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._step_at_batch_start = trainer.global_step
        self._epoch["samples"] += extract_batch_size(batch) * trainer.world_size

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        every = trainer.log_every_n_steps or 1
        if step == self._step_at_batch_start or step % every:
            return  # no optimizer step in this batch, or not a logging step
        loss = trainer.callback_metrics.get("train/loss")
        self.history["steps"].append(
            {"step": step, "epoch": trainer.current_epoch, "train_loss": _float(loss), "lr": _lr(trainer)}
        )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self._clock is not None:
            self._epoch["train_s"] += time.perf_counter() - self._clock
            self._clock = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = trainer.callback_metrics
        self.history["validations"].append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "val_acc": _float(metrics.get("val/acc")),
                "val_loss": _float(metrics.get("val/loss")),
                "lr": _lr(trainer),
            }
        )
        self._clock = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:
            self._epoch["train_s"] += time.perf_counter() - self._clock
            self._clock = None
        metrics = trainer.callback_metrics
        last = self.history["validations"][-1] if self.history["validations"] else {}
        seconds = self._epoch["train_s"]
        row = {
            "epoch": trainer.current_epoch,
            "epochs": trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None,
            "step": trainer.global_step,
            "train_loss": _float(metrics.get("train/loss_epoch", metrics.get("train/loss"))),
            "val_acc": last.get("val_acc") if last.get("epoch") == trainer.current_epoch else None,
            "lr": _lr(trainer),
            "samples_per_sec": self._epoch["samples"] / seconds if seconds > 0 else None,
            "resumed_at_batch": self._epoch.get("resumed_at_batch"),
        }
        self._epoch["samples"] = 0.0  # said; a further on_train_epoch_start starts a new one
        if self.print_epochs and rank_zero_only.rank == 0:
            print(epoch_line(row), flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is None or not trainer.is_global_zero:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "training.json").write_text(json.dumps(self.history, indent=2) + "\n")
        title = f"{type(pl_module).__name__}: {trainer.global_step} optimizer steps, {trainer.world_size} device(s)"
        path = self.output_dir / "training.png"
        save_png(lambda: training_figure(self.history, title), path, "TrainingReport", rank_zero_info)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _lr(trainer: pl.Trainer) -> float | None:
    return float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else None
