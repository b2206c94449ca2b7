"""AccelParallel's distributed checkpoints resume under another layout, at an epoch's end and mid-epoch.

A run under layout A saves a sharded (DCP) checkpoint after k optimizer steps; a run under layout B resumes from it.
The parameters and SGD momentum buffers B loads equal the ones A saved (within 1e-7: moved, not recomputed), and the
steps after the resume equal one process's uninterrupted run on the same global batches (gradients and final state
within 1e-6). Mid-epoch, a resumable loader continues at the next batch, so no batch is replayed or skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from lit_accel import AccelParallel
from tests.helpers import run_distributed
from tests.helpers.models import small_trainer_kwargs
from tests.helpers.parallel import GradRecorder, PipeModel, dataset, fit_reference, full, merge
from tests.test_resume import _ResumableLoader

GLOBAL_BATCH, SAMPLES, TOTAL_STEPS, SEED = 16, 64, 6, 3  # 4 steps per epoch


class _LoadedState(pl.Callback):
    """The full parameters and momentum buffers right after a resume restored them."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = _state(trainer, module)


def _state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    momentum = {names[id(p)]: full(s["momentum_buffer"]) for p, s in optimizer.state.items() if "momentum_buffer" in s}
    return {"params": {n: full(p) for n, p in module.named_parameters()}, "momentum": momentum}


def _run(rank: int, world: int, strategy_kwargs: dict[str, Any], steps: int, path: str, resume: bool) -> dict:
    pl.seed_everything(0, verbose=False)
    strategy = AccelParallel(**strategy_kwargs)
    layout = strategy.plan.for_world("t", world).layout
    data = dataset(SAMPLES)
    # Shuffled per epoch (the same permutation in every layout): a replayed or skipped batch shows.
    sampler = DistributedSampler(data, layout.data, layout.data_rank(rank), shuffle=True, seed=SEED)
    loader = _ResumableLoader(data, batch_size=GLOBAL_BATCH // layout.data, sampler=sampler)
    recorder, loaded = GradRecorder(), _LoadedState()
    # Saved inside the loop (at the last step's batch end), as in a real run: the loader's position is part of it.
    saver = ModelCheckpoint(dirpath=Path(path).parent, filename=Path(path).stem, every_n_train_steps=steps)
    kwargs = small_trainer_kwargs(devices=world, max_steps=steps, max_epochs=-1, enable_checkpointing=not resume)
    trainer = pl.Trainer(strategy=strategy, callbacks=[recorder, loaded] + ([] if resume else [saver]),
                         use_distributed_sampler=False, **kwargs)  # fmt: skip
    model = PipeModel()
    trainer.fit(model, loader, ckpt_path=path if resume else None)
    final = _state(trainer, model)
    return {"final": final, "loaded": getattr(loaded, "state", None), "grads": recorder.grads}


PAIRS = {
    "fsdp4-to-pp2xfsdp2": (({}, 4), ({"pipeline_parallel": 2}, 4), 4),
    "fsdp2xtp2-to-pp2xtp2-mid-epoch": (
        ({"tensor_parallel": 2}, 4),
        ({"pipeline_parallel": 2, "tensor_parallel": 2}, 4),
        3,
    ),
    "fsdp4-to-pp2xfsdp2xtp2-mid-epoch": (({}, 4), ({"pipeline_parallel": 2, "tensor_parallel": 2}, 8), 2),
}


@pytest.mark.parametrize(
    "pair", [pytest.param(name, marks=pytest.mark.slow) if "mid-epoch" in name else name for name in PAIRS]
)
def test_resume_under_another_layout(pair, tmp_path: Path):
    (saved_kwargs, saved_world), (resumed_kwargs, resumed_world), at_step = PAIRS[pair]
    path = str(tmp_path / "saved.ckpt")
    saved = run_distributed(_run, saved_world, saved_kwargs, at_step, path, False, init_process_group=False)
    resumed = run_distributed(_run, resumed_world, resumed_kwargs, TOTAL_STEPS, path, True, init_process_group=False)
    assert Path(path).is_dir()  # a distributed checkpoint, one shard per rank

    for key in ("params", "momentum"):  # what B loaded is what A saved (DCP moves values, it does not recompute)
        before = {n: v for r in saved for n, v in r["final"][key].items()}
        after = {n: v for r in resumed for n, v in r["loaded"][key].items()}
        assert after.keys() == before.keys()
        for name in before:
            torch.testing.assert_close(after[name], before[name], atol=1e-7, rtol=0, msg=f"loaded {key} {name}")

    reference = fit_reference(SAMPLES, GLOBAL_BATCH, TOTAL_STEPS, shuffle_seed=SEED, use_distributed_sampler=False)
    grads = merge(resumed, "grads")
    assert len(grads) == TOTAL_STEPS - at_step  # no batch replayed or skipped
    for i, got in enumerate(grads):
        want = reference["grads"][at_step + i]
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=f"step {at_step + i} {name}")
    final = {n: v for r in resumed for n, v in r["final"]["params"].items()}
    for name, want in reference["params"].items():
        torch.testing.assert_close(final[name], want, atol=1e-6, rtol=0, msg=name)
