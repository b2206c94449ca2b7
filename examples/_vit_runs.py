"""Runs of ``examples/vit.py`` as timm's ``train.py`` keeps them: one folder each, never reused, resumable.

A run lives in ``<output>/<YYYYmmdd-HHMMSS>-<model>-<img_size>`` (or ``<output>/<experiment>``), with ``-1``, ``-2``
... added when that folder exists, so a second run never touches the first. ``--resume PATH`` continues the run a
checkpoint belongs to, in its own folder; ``--resume last`` takes the run under ``--output`` whose
``checkpoints/last.ckpt`` was written last. The processes of one multi-process run agree on the folder: rank 0
creates it and hands its path to the processes Lightning starts through :data:`RUN_DIR_ENV` (torchrun's ranks other
than 0 write nothing there; the checkpoint callback broadcasts rank 0's folder).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_accel.layout.batch_plan import make_batch_plan, nearest_divisors, nearest_global_batch_sizes

__all__ = [
    "RUN_DIR_ENV",
    "StopAtStep",
    "check_global_batch",
    "create_run_dir",
    "find_checkpoint",
    "run_dir_of",
]

#: Where rank 0 leaves the run folder for the processes it launches (they re-run the script with its environment).
RUN_DIR_ENV = "LIT_ACCEL_EXAMPLE_RUN_DIR"
CONFIG_NAME = "config.yaml"


def _is_child_rank() -> bool:
    """A process started for a rank other than 0 (by Lightning's launcher or by torchrun)."""
    return any(os.environ.get(key, "0") != "0" for key in ("LOCAL_RANK", "RANK", "NODE_RANK"))


def create_run_dir(output: Path, experiment: str | None, model: str, img_size: int) -> Path:
    """A new run folder under ``output`` (created on rank 0; the other ranks get rank 0's path or a name only)."""
    if _is_child_rank() and os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    name = experiment or "-".join((datetime.now().strftime("%Y%m%d-%H%M%S"), _safe(model), str(img_size)))
    path = output / name
    if _is_child_rank():
        return path  # torchrun's rank k > 0: nothing of ours is written here before ModelCheckpoint's broadcast
    output.mkdir(parents=True, exist_ok=True)
    for suffix in range(10_000):
        candidate = path if suffix == 0 else output / f"{name}-{suffix}"
        try:
            candidate.mkdir()  # atomic: two runs started in the same second get different folders
        except FileExistsError:
            continue
        os.environ[RUN_DIR_ENV] = str(candidate)  # for the processes Lightning starts (they inherit this environment)
        return candidate
    raise FileExistsError(f"{path}: 10,000 runs of this name already exist; pass --experiment NAME")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name)


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run folder of ``<run>/checkpoints/<name>.ckpt`` (one with a ``config.yaml``), else ``None``."""
    run = checkpoint.parent.parent
    return run if checkpoint.parent.name == "checkpoints" and (run / CONFIG_NAME).is_file() else None


def find_checkpoint(resume: str, output: Path) -> Path:
    """The checkpoint ``--resume`` names: a ``.ckpt`` file, a run folder (its ``last.ckpt``) or ``last``.

    Raises:
        ValueError: nothing to resume there, in one sentence naming the path and what to pass instead.
    """
    if resume == "last":
        runs = [path.parent.parent for path in output.glob("*/checkpoints/last.ckpt")] if output.is_dir() else []
        if not runs:
            raise ValueError(
                f"--resume last: no run under --output {str(output)!r} has a checkpoints/last.ckpt; pass a checkpoint"
                " path, or the --output of the run to continue"
            )
        newest = max(runs, key=lambda run: ((run / "checkpoints" / "last.ckpt").stat().st_mtime, run.name))
        return newest / "checkpoints" / "last.ckpt"
    path = Path(resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ValueError(f"--resume {resume!r}: no checkpoint file there; pass a .ckpt file, a run folder or 'last'")
    return path


def check_global_batch(global_batch_size: int, batch_size: int, world_size: int) -> int:
    """The accumulation of ``global_batch_size`` with lit_accel's plan, or a ``ValueError`` in the flags' words."""
    try:
        return make_batch_plan(global_batch_size, batch_size, world_size).accumulate_grad_batches
    except ValueError:
        pass
    step = batch_size * world_size
    globals_ = " or ".join(map(str, nearest_global_batch_sizes(global_batch_size, batch_size, world_size)))
    fix = f"--global-batch-size {globals_}"
    if global_batch_size % world_size == 0:
        sizes = " or ".join(map(str, nearest_divisors(global_batch_size // world_size, batch_size)))
        fix += f", or --batch-size {sizes}"
    raise ValueError(
        f"--global-batch-size {global_batch_size} is not divisible by --batch-size {batch_size} x {world_size} devices"
        f" = {step}. Fix: {fix}"
    )


class StopAtStep(Callback):
    """Stop after ``max_steps`` optimizer steps (``None``: at ``Trainer(max_steps)``) with a validation inside fit.

    Lightning validates when a fit is asked to stop (``trainer.should_stop``), not when it reaches ``max_steps``
    mid-epoch; stopping this way gives the final weights a validation and a checkpoint inside fit, so no separate
    ``trainer.validate`` (and its DistributedSampler warning) is needed. A budget given here leaves
    ``Trainer(max_steps)`` at -1, so the LR schedule still spans the planned epochs and a resumed run continues it.
    """

    def __init__(self, max_steps: int | None = None) -> None:
        self.max_steps = max_steps

    def _limit(self, trainer: pl.Trainer) -> int:
        return self.max_steps if self.max_steps is not None else trainer.max_steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        limit = self._limit(trainer)
        if 0 < limit <= trainer.global_step:  # a resumed run that is already there
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        limit = self._limit(trainer)
        if 0 < limit <= trainer.global_step:
            trainer.should_stop = True
