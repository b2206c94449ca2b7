"""The pipeline contract, checked (issue #45): a model whose ``forward`` is not its units in order is never split.

The check traces ``forward`` (``layout/chain.py``); the refusals come before the first optimizer step on every rank
of a real 2-process gloo job, and a model that keeps the contract (units in order, a tuple passed on) still splits.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lit_accel import AccelParallel, PipelineLoss
from lit_accel.layout.chain import check_chain
from lit_accel.layout.stages import pipeline_units
from tests.helpers import run_distributed
from tests.helpers.models import small_trainer_kwargs
from tests.helpers.parallel import IN, OUT, PipeModel, dataset


class _Three(PipelineLoss, pl.LightningModule):
    """Three Linear units; ``kind`` says how ``forward`` combines them (issue #45's cases)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b, self.head = nn.Linear(IN, 8), nn.Linear(8, 8), nn.Linear(8, OUT)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "residual":
            h = self.a(x)
            return self.head(h + self.b(h))
        if self.kind == "activation":
            return self.head(self.b(torch.tanh(self.a(x))))
        if self.kind == "order":  # b registered before head, called after it would need other widths: swap a and b
            return self.head(self.a(self.b(x)))
        return self.head(self.b(self.a(x)))  # the contract

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x), x


class _Merge(nn.Module):
    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        return h + x


class _Tuple(nn.Module):
    """A residual the contract way: one unit returns (h, x), the next takes both."""

    def __init__(self) -> None:
        super().__init__()
        self.pair, self.merge = _Pair(), _Merge()

    def forward(self, x: Tensor) -> Tensor:
        h, x = self.pair(x)  # (torch.fx traces an unpacking, not a star-call of a unit's output)
        return self.merge(h, x)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else h  # data-dependent control flow: not traceable


def _check(module: nn.Module) -> str | None:
    try:
        check_chain("AccelParallel", module, [name for name, _ in pipeline_units(module)])
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    ("kind", "names"),
    [("residual", "'add' (of a, b) runs between units"), ("activation", "'tanh' (of a) runs between units"),
     ("order", "forward calls 'b' where the registration order has 'a'")],
)  # fmt: skip
def test_a_forward_that_is_not_its_units_in_order_is_named(kind, names):
    message = _check(_Three(kind))
    assert message is not None and names in message and "Fix: make forward apply the units" in message, message


def test_the_contract_passes_with_loops_containers_and_tuples():
    assert _check(_Three("chain")) is None
    assert _check(PipeModel()) is None  # embed, a loop over a ModuleList, norm, head
    assert _check(PipeModel(norm=False)) is None  # an nn.Identity unit
    assert _check(_Tuple()) is None  # a tuple passed on as positional arguments
    with torch.device("meta"):
        assert _check(PipeModel()) is None  # nothing runs: a model not yet materialised is checked too


def test_a_forward_that_cannot_be_traced_is_refused():
    message = _check(_Branchy())
    assert message is not None and "cannot be traced" in message and "Fix:" in message, message


def _fit(rank: int, world: int, kind: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=2, schedule="gpipe", microbatches=2),
                         **small_trainer_kwargs(devices=world, max_steps=2, max_epochs=-1))  # fmt: skip
    try:
        trainer.fit(_Three(kind), DataLoader(dataset(32), batch_size=8))
    except ValueError as err:
        return {"error": str(err), "steps": trainer.global_step}
    return {"error": None, "steps": trainer.global_step}


@pytest.mark.parametrize("kind", ["residual", "activation", "order"])
def test_a_pipeline_refuses_a_different_model_on_every_rank_before_the_first_step(kind):
    for result in run_distributed(_fit, 2, kind, init_process_group=False, timeout=120):
        assert result["steps"] == 0 and result["error"] is not None, result
        assert "would train a different model" in result["error"], result["error"]


def test_a_pipeline_of_a_model_that_keeps_the_contract_still_trains():
    for result in run_distributed(_fit, 2, "chain", init_process_group=False, timeout=120):
        assert result == {"error": None, "steps": 2}


class _UpDown(PipelineLoss, pl.LightningModule):
    """Linear(IN, 8) then Linear(8, OUT): issue #45's pair, for tensor plans the right and the wrong way round."""

    def __init__(self, act: str = "relu") -> None:
        super().__init__()
        # a softmax over the hidden width is parameter-free, so "auto" pairs up and down across it, but it is not
        # elementwise: on a shard it normalises over half the width
        activation = nn.Softmax(dim=-1) if act == "softmax" else nn.ReLU()
        self.up, self.act, self.down = nn.Linear(IN, 8), activation, nn.Linear(8, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("plan", "entry"),
    [({"up": "rowwise", "down": "colwise"}, "entry 'up': 'rowwise' has no partner"),
     ({"up": "colwise"}, "entry 'up': 'colwise' has no partner")],
)  # fmt: skip
def test_a_tensor_plan_without_its_pairs_is_refused_naming_the_entry(plan, entry):
    from lit_accel.layout.tensor_plan import resolve_plan

    with pytest.raises(ValueError, match="Fix: pair each 'colwise' Linear") as info:
        resolve_plan("AccelParallel", _UpDown(), plan, 2)
    assert entry in str(info.value), info.value
    assert resolve_plan("AccelParallel", _UpDown(), {"up": "colwise", "down": "rowwise"}, 2)  # the right way round


def _fit_plan(rank: int, world: int, plan: Any, act: str = "relu") -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = _UpDown(act)
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    trainer = pl.Trainer(strategy=AccelParallel(tensor_parallel=2, tensor_plan=plan),
                         **small_trainer_kwargs(devices=world, max_steps=2, max_epochs=-1))  # fmt: skip
    try:
        trainer.fit(model, DataLoader(dataset(32), batch_size=8))
    except ValueError as err:
        from tests.helpers.parallel import full

        moved = [name for name, value in model.state_dict().items() if not torch.equal(full(value), before[name])]
        return {"error": str(err), "steps": trainer.global_step, "moved": moved}
    return {"error": None, "steps": trainer.global_step}


def test_a_wrong_tensor_plan_is_refused_on_every_rank_before_the_first_step():
    for result in run_distributed(_fit_plan, 2, {"up": "rowwise", "down": "colwise"}, init_process_group=False,
                                  timeout=120):  # fmt: skip
        assert result["steps"] == 0 and "entry 'up'" in (result["error"] or ""), result
        assert result["moved"] == [], result
    for result in run_distributed(_fit_plan, 2, {"up": "colwise", "down": "rowwise"}, init_process_group=False,
                                  timeout=120):  # fmt: skip
        assert result == {"error": None, "steps": 2}


def test_a_plan_that_shards_across_an_operation_that_is_not_elementwise_is_refused_before_the_first_step():
    """The sharded forward is compared with the unsharded one on the first batch (layout/tensor_check.py): "auto"
    pairs up and down across a softmax over the hidden width, which would train a different model."""
    for result in run_distributed(_fit_plan, 2, "auto", "softmax", init_process_group=False, timeout=120):
        error = result["error"] or ""
        assert result["steps"] == 0 and result["moved"] == [], result
        assert "the tensor plan would train a different model: the model gives another output sharded" in error, error
        assert "relative difference" in error and "Fix: pair each 'colwise' Linear" in error, error
    for result in run_distributed(_fit_plan, 2, "auto", "relu", init_process_group=False, timeout=120):
        assert result == {"error": None, "steps": 2}  # elementwise between the pair: checked, equal, trained


def _fit_twice(rank: int, world: int) -> list[bool]:
    armed: list[bool] = []

    class Armed(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            armed.append(trainer.strategy._plan_check.armed)

    strategy = AccelParallel(tensor_parallel=2)
    trainer = pl.Trainer(strategy=strategy, callbacks=[Armed()],
                         **small_trainer_kwargs(devices=world, max_steps=2, max_epochs=-1))  # fmt: skip
    model = _UpDown()
    trainer.fit(model, DataLoader(dataset(32), batch_size=8))
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, DataLoader(dataset(32), batch_size=8))  # the same model, as built: checked once
    return armed


def test_the_plan_is_checked_in_the_first_step_of_the_first_fit_only():
    for armed in run_distributed(_fit_twice, 2, init_process_group=False, timeout=120):
        assert armed == [True, False, False, False], armed  # no hook (nor an eager compiled step) after the verdict


def test_models_as_timm_defines_them_pass_only_when_their_units_are_the_forward():
    """timm's ResNet is its units in order (the chained units give its own output); its ViT is not (the class token
    and the position embedding are added between units) and is refused."""
    import timm

    from lit_accel.layout.stages import StageModule

    resnet = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    assert _check(resnet) is None
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(StageModule(0, pipeline_units(resnet))(images), resnet(images))
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    message = _check(vit)
    assert message is not None and "runs between units" in message and "Fix:" in message, message
