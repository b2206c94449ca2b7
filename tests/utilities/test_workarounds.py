"""The fenced upstream fixes of ``lit_accel/utilities/_workarounds.py``: each gate, and each upstream bug, still there.

Every entry of ``WORKAROUNDS`` has a ``test_upstream_still_<name>`` test (here or next to the feature it protects)
that runs plain upstream code and asserts the bug. When an upgrade fixes it the test fails with the entry's name:
narrow that entry's ``affected`` range to the broken versions and the fix switches itself off on fixed ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from packaging.specifiers import SpecifierSet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel.utilities import _workarounds
from lit_accel.utilities._workarounds import WORKAROUNDS
from tests.helpers import run_distributed, small_trainer_kwargs

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(WORKAROUNDS))
def test_every_workaround_is_fenced_and_applies_to_the_installed_versions(name):
    entry = WORKAROUNDS[name]
    SpecifierSet(entry.affected)  # a valid PEP 440 range
    assert entry.package in ("lightning", "torch") and re.match(r"https://(github\.com|pytorch\.org)/", entry.issue)
    assert entry.applies(), f"{name} does not apply to the installed {entry.package}: re-check it, then the gate"
    tests = "".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    assert f"def test_upstream_still_{name}(" in tests, f"{name} has no test_upstream_still_{name}"


def test_a_fix_switches_itself_off_outside_its_range(monkeypatch):
    monkeypatch.setitem(
        WORKAROUNDS, "partial_window", WORKAROUNDS["partial_window"].__class__("lightning", "<1", "", "")
    )
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    _workarounds.rescale_partial_window_([param], accumulation=4, micro_batches=2)
    assert torch.equal(param.grad, torch.ones(2))  # untouched: "fixed upstream"
    monkeypatch.undo()
    _workarounds.rescale_partial_window_([param], accumulation=4, micro_batches=2)
    assert torch.equal(param.grad, torch.full((2,), 2.0))


class _Scalar(pl.LightningModule):
    """loss = w, so every micro-batch adds 1/k to w's gradient (Lightning divides by the configured k)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.steps: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.w + 0 * batch[0].sum()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.steps.append(float(self.w.grad))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_upstream_still_partial_window():
    """Lightning #19987: windows of 4, 2 micro-batches; the short one's gradient is 2/4 of a mean, not 1."""
    model = _Scalar()
    loader = DataLoader(TensorDataset(torch.zeros(6, 1)), batch_size=1)
    pl.Trainer(**small_trainer_kwargs(max_epochs=1, max_steps=-1, accumulate_grad_batches=4)).fit(model, loader)
    assert model.steps == [1.0, 0.5], "Lightning fixed #19987: narrow WORKAROUNDS['partial_window']"


def test_upstream_still_backward_scale_unscale():
    """torch's GradScaler divides by the current scale, which an update after the backward has already halved."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    first, second = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    opt_a, opt_b = torch.optim.SGD([first], lr=0.1), torch.optim.SGD([second], lr=0.1)
    scaler.scale(first.sum() * float("inf") + second.sum()).backward()  # one backward feeds both optimizers
    scaler.step(opt_a)
    scaler.update()  # overflow in opt_a's gradients: the scale halves to 4 before opt_b unscales
    scaler.unscale_(opt_b)
    assert second.grad.item() == 8.0 / 4.0, "torch unscales with the backward's scale now: narrow the workaround"


def _hook_calls_under_ddp_strategy(rank: int, world_size: int) -> int:
    calls = []

    def hook(state, bucket):  # unannotated: DDP rejects the string annotations `from __future__` makes
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = DDPStrategy(ddp_comm_hook=hook)
    trainer = pl.Trainer(**small_trainer_kwargs(devices=world_size, max_steps=2, strategy=strategy))
    trainer.fit(Model(), DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2))
    return len(calls)


def test_upstream_still_comm_hooks_on_cpu():
    """Lightning's DDPStrategy registers ddp_comm_hook only on CUDA: on CPU/gloo the hook never runs."""
    calls = run_distributed(_hook_calls_under_ddp_strategy, 2, init_process_group=False, timeout=120)
    assert calls == [0, 0], "DDPStrategy registers comm hooks on CPU now: narrow WORKAROUNDS['comm_hooks_on_cpu']"
