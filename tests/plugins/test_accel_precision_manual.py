"""AccelPrecision under manual optimization: several optimizers, idle optimizers, closure optimizers, empty batches.

The scale is updated after every optimizer step (as in Lightning), but every optimizer unscales its gradients with the
scale they were computed with: Lightning's ``MixedPrecision`` (and a bare ``torch.amp.GradScaler`` used the same way)
unscales the second optimizer of a backward with the scale the first one's update left, halving or doubling it.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import AccelPrecision, DynamicGradScaler, NonFiniteGuard
from tests.helpers import small_trainer_kwargs

INF = float("inf")


class TwoOptimizers(pl.LightningModule):
    """One loss, one backward, two optimizers (a backbone/head split). Records what each optimizer step sees.

    With lr=0 the weights never move, so every gradient is exactly ``sum(x) = 4`` per weight row when unscaled.
    ``overflow_a`` puts inf into the first optimizer's gradients at those iterations (the head stays finite),
    ``overflow_both`` into both.
    """

    def __init__(self, overflow_a=(), overflow_both=(), lr=0.0, optimizer=torch.optim.SGD):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(4, 1, bias=False)
        self.b = nn.Linear(4, 1, bias=False)
        self.overflow_a, self.overflow_both = set(overflow_a), set(overflow_both)
        self.lr, self.optimizer = lr, optimizer
        self.seen: list[tuple[str, float]] = []
        self.iteration = 0

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        factor = INF if self.iteration in self.overflow_a else 1.0
        both = INF if self.iteration in self.overflow_both else 1.0
        self.iteration += 1
        loss = (self.a(x).float().sum() * factor + self.b(x).float().sum()) * both
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def on_before_optimizer_step(self, optimizer):
        name = "a" if optimizer.param_groups[0]["params"][0] is self.a.weight else "b"
        self.seen.append((name, optimizer.param_groups[0]["params"][0].grad.sum().item()))

    def configure_optimizers(self):
        return self.optimizer(self.a.parameters(), lr=self.lr), self.optimizer(self.b.parameters(), lr=self.lr)


def _fit(model, plugin, steps, batches=8, **kwargs):
    plugins = [] if plugin is None else [plugin]
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=steps, plugins=plugins, **kwargs))
    data = TensorDataset(torch.ones(2 * batches, 4))
    trainer.fit(model, DataLoader(data, batch_size=2))
    return trainer


def test_several_optimizers_on_one_backward_unscale_with_the_scale_of_their_gradients():
    # growth_interval=1: the scale doubles after every clean optimizer step, so it has moved by the time the second
    # optimizer unscales. Lightning's MixedPrecision would hand it half its gradient (4.0).
    model = TwoOptimizers()
    plugin = AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=1))
    _fit(model, plugin, steps=2 * 4)  # global_step counts both optimizers' steps: 4 iterations
    assert model.seen == [(name, 8.0) for _ in range(4) for name in "ab"]  # 2 samples x 4 ones, unscaled
    stats = plugin.scaler.scaler_stats()
    assert stats.scale.item() == 2.0**12  # one update per optimizer step
    assert stats.growths.item() == 8


def test_fused_optimizers_get_the_scale_of_their_gradients_too():
    # Fused kernels unscale inside step() with the scale GradScaler hands them: it must be the gradients' scale.
    lr = 2.0**-4
    model = TwoOptimizers(lr=lr, optimizer=functools.partial(torch.optim.SGD, fused=True))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _fit(
        model,
        AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=1)),
        steps=2 * 4,
    )
    for name, param in model.named_parameters():  # d(sum of outputs)/dw = 2 per element, 4 steps of lr * 2
        assert torch.equal(param.detach(), start[name] - 4 * lr * 2), name


@pytest.mark.parametrize("clip", [False, True])
def test_one_optimizer_stepping_twice_in_a_batch_sees_its_exact_gradients(clip):
    # Truncated backprop / inner loops: backward + (clip) + step twice inside one training_step.
    class Twice(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            opt_a, _ = self.optimizers()
            for _ in range(2):
                self.manual_backward(self.a(x).float().sum())
                if clip:
                    self.clip_gradients(opt_a, gradient_clip_val=100.0, gradient_clip_algorithm="norm")
                opt_a.step()
                opt_a.zero_grad()

    model = Twice()
    _fit(
        model,
        AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=1)),
        steps=2 * 3,
    )
    assert model.seen == [("a", 8.0)] * 6


def test_an_overflow_in_one_optimizer_skips_only_its_step_and_backs_off_once():
    model = TwoOptimizers(overflow_a={1}, lr=0.1)
    plugin = AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=100))
    before_a = None

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            nonlocal before_a
            if pl_module.iteration == 1:
                before_a = pl_module.a.weight.detach().clone()
            if pl_module.iteration == 2:
                # iteration 1 overflowed in a only: a did not move, b did
                assert torch.equal(pl_module.a.weight, before_a)

    _fit(model, plugin, steps=2 * 3, callbacks=[Snapshot()])
    stats = plugin.scaler.scaler_stats()
    # The head's finite gradient after the overflowing iteration is still unscaled with the scale it was made with.
    assert [g for name, g in model.seen if name == "b"] == [8.0, 8.0, 8.0]
    assert stats.scale.item() == 2.0**3  # backed off once for the one bad iteration
    assert stats.skipped_steps.item() == 1  # counts iterations with an overflow
    assert stats.backoffs.item() == 1


def test_hysteresis_counts_optimizer_steps():
    # Both optimizers overflow in one iteration: two consecutive overflowing steps, so hysteresis=2 backs off once.
    model = TwoOptimizers(overflow_both={1})
    plugin = AccelPrecision(
        "16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=100, hysteresis=2)
    )
    _fit(model, plugin, steps=2 * 3)
    stats = plugin.scaler.scaler_stats()
    assert stats.scale.item() == 2.0**3
    assert stats.skipped_steps.item() == 2 and stats.backoffs.item() == 1


def test_reading_the_scale_between_two_optimizers_changes_nothing():
    # A callback may read the scaler at any time (here before every optimizer step): the gradients stay exact.
    class Reader(pl.Callback):
        def __init__(self):
            self.scales = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.scales.append(trainer.precision_plugin.loss_scale)
            trainer.precision_plugin.scaler.scaler_stats()

    model, reader = TwoOptimizers(), Reader()
    _fit(
        model,
        AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**4, growth_interval=1)),
        steps=2 * 3,
        callbacks=[reader],
    )
    assert model.seen == [(name, 8.0) for _ in range(3) for name in "ab"]
    assert reader.scales == [2.0 ** (4 + i) for i in range(6)]


class IdleOptimizer(pl.LightningModule):
    """Two optimizers, but only the first one's parameters take part in the loss on odd batches."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        loss = self.a(x).float().sum() + (self.b(x).float().sum() if batch_idx % 2 == 0 else 0.0)
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()  # no gradients on odd batches: a plain no-op step, as in Lightning
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_an_optimizer_without_gradients_is_stepped_plainly(precision):
    model = IdleOptimizer()
    # No overflow and no NaN: every skip, by the scaler or by the guard (bf16, fp32), would be a bug.
    plugin = AccelPrecision(precision, "cpu", DynamicGradScaler(init_scale=2.0**4)) if precision == "16-mixed" else None
    plugin = AccelPrecision(precision, "cpu") if precision == "bf16-mixed" else plugin
    guard = NonFiniteGuard(action="skip")
    b_before = model.b.weight.detach().clone()
    _fit(model, plugin, steps=2 * 4, callbacks=[guard])
    assert guard.skipped_steps == 0 and (plugin is None or plugin.skipped_steps == 0)
    assert guard.active is (precision != "16-mixed")  # the fp16 scaler checks its own steps
    assert not torch.equal(model.b.weight, b_before)  # it still learned on the even batches


class ClosureOptimizer(torch.optim.SGD):
    """Like SAM: ``step()`` re-evaluates the closure itself and refuses to run without it."""

    def step(self, closure=None):
        assert closure is not None, "ClosureOptimizer requires closure, but it was not provided"
        with torch.enable_grad():
            closure()
        return super().step()


class ClosureModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).float().pow(2).mean()

    def configure_optimizers(self):
        return ClosureOptimizer(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_an_optimizer_that_needs_the_closure_runs_guarded(precision):
    # The guard checks inside the closure (on_before_optimizer_step), so an optimizer that runs the closure itself in
    # step() (SAM) is guarded like any other, with Lightning's own step.
    model = ClosureModel()
    before = model.net.weight.detach().clone()
    plugin = AccelPrecision(precision, "cpu") if precision == "bf16-mixed" else None
    _fit(model, plugin, steps=2, callbacks=[NonFiniteGuard()])
    assert not torch.equal(model.net.weight, before)
    bad = ClosureModel()
    bad.training_step = lambda batch, batch_idx: bad.net(batch[0]).float().pow(2).mean() * float("nan")
    with pytest.raises(RuntimeError, match=r"non-finite gradients .* at optimizer step 0 \(batch_idx 0\)"):
        _fit(bad, plugin, steps=2, callbacks=[NonFiniteGuard()])
    assert all(torch.isfinite(p).all() for p in bad.parameters())


class NoneAfterOverflow(pl.LightningModule):
    """Batch 0 overflows (fp16), batch 1 returns None (no backward, no step), then normal batches."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if batch_idx == 1:
            return None
        loss = self.net(x).float().pow(2).mean()
        return loss * INF if batch_idx == 0 else loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_batch_without_backward_advances_the_scheduler_as_lightning_does_even_after_a_skipped_step():
    model = NoneAfterOverflow()
    trainer = pl.Trainer(**small_trainer_kwargs(max_epochs=1, max_steps=-1, plugins=[AccelPrecision("16-mixed")]))
    trainer.fit(model, DataLoader(TensorDataset(torch.ones(6, 4)), batch_size=2))
    # batch 0: skipped step, LR kept; batch 1: no backward, Lightning steps the scheduler; batch 2: a real step.
    assert model.lrs == [1.0, 0.5, 0.25]
