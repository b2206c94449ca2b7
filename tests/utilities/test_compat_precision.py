"""The private torch/Lightning internals AccelPrecision and DynamicGradScaler rely on: fail loudly if they move."""

import lightning.pytorch as pl
import torch

from lit_accel.utilities import _compat
from tests.helpers import BNModel, make_dataset, make_loader, small_trainer_kwargs


def _setup(fused: bool = False):
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


class _CountingScaler(torch.amp.GradScaler):
    calls = 0


def _count(self, optimizer, optimizer_state, *args, **kwargs):
    type(self).calls += 1
    found = _compat.optimizer_state_found_infs(optimizer_state)
    assert found and all(isinstance(f, torch.Tensor) and f.shape == () for f in found)
    return torch.amp.GradScaler._maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs)


setattr(_CountingScaler, _compat.GRAD_SCALER_SKIP_HOOK, _count)


def test_grad_scaler_step_goes_through_the_skip_hook_for_plain_optimizers_only():
    _compat.check_grad_scaler_skip_hook()
    for fused, expected_calls in ((False, 1), (True, 0)):
        _CountingScaler.calls = 0
        scaler = _CountingScaler("cpu", init_scale=4.0)
        model, opt = _setup(fused)
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert _CountingScaler.calls == expected_calls


def test_found_infs_are_recorded_per_optimizer_until_reset():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model, opt = _setup()
    assert _compat.grad_scaler_found_infs(scaler) == []
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("nan")
    scaler.unscale_(opt)
    assert [f.item() for f in _compat.grad_scaler_found_infs(scaler)] == [1.0]
    assert _compat.grad_scaler_step_skipped(scaler, opt).item() == 1.0  # torch's scaler: the device flag
    _compat.reset_grad_scaler_iteration(scaler)
    assert _compat.grad_scaler_found_infs(scaler) == []
    # The defaultdict keeps its factory: the next iteration works as after update().
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_scaler_tensors_can_be_created_eagerly():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert _compat.grad_scaler_growth_tracker(scaler) is None
    _compat.init_grad_scaler_tensors(scaler, torch.device("cpu"))
    tracker = _compat.grad_scaler_growth_tracker(scaler)
    assert tracker is not None and tracker.dtype == torch.int32 and tracker.item() == 0
    assert _compat.grad_scaler_scale(scaler).item() == 8.0


class _LegacyScalingSGD(torch.optim.SGD):
    """An optimizer on torch's deprecated contract: it receives the scaler in step() and unscales by itself."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self._step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        return super().step(closure)


def test_optimizer_scaling_capabilities():
    model = torch.nn.Linear(2, 2)
    assert _compat.optimizer_handles_amp_scaling(torch.optim.AdamW(model.parameters(), fused=True))
    assert not _compat.optimizer_handles_amp_scaling(torch.optim.AdamW(model.parameters()))
    assert not _compat.optimizer_takes_grad_scaler(torch.optim.AdamW(model.parameters(), fused=True))
    assert _compat.optimizer_takes_grad_scaler(_LegacyScalingSGD(model.parameters(), lr=0.1))


class _BatchIdxProbe(pl.Callback):
    def __init__(self):
        self.pairs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.pairs.append((batch_idx, _compat.train_batch_idx(trainer)))


def test_train_batch_idx_is_the_hooks_batch_idx():
    probe = _BatchIdxProbe()
    trainer = pl.Trainer(**small_trainer_kwargs(max_epochs=2, max_steps=-1, callbacks=[probe]))
    trainer.fit(BNModel(), make_loader(make_dataset(24), 8))
    assert probe.pairs == [(i, i) for i in range(3)] * 2


class _StepProbe(pl.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, _compat.batches_that_stepped(trainer)))


def test_batch_counters_under_accumulation_across_epochs():
    # 3 batches per epoch, accumulation 2: steps after batches 1 and 2 (the epoch's last), in each epoch.
    probe = _StepProbe()
    trainer = pl.Trainer(
        **small_trainer_kwargs(max_epochs=2, max_steps=-1, accumulate_grad_batches=2, callbacks=[probe])
    )
    trainer.fit(BNModel(), make_loader(make_dataset(24), 8))
    # (global_step, batches that stepped before this batch's increment)
    assert probe.rows == [(0, 0), (1, 0), (2, 1), (2, 2), (3, 2), (4, 3)]


def test_grad_scaler_scale_swapped_is_what_unscale_divides_by_and_is_restored():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 8.0)
    opt = torch.optim.SGD([param], lr=0.1)
    _compat.init_grad_scaler_tensors(scaler, torch.device("cpu"))
    current = _compat.grad_scaler_scale(scaler)
    with _compat.grad_scaler_scale_swapped(scaler, torch.tensor(2.0)):
        scaler.unscale_(opt)
    assert torch.equal(param.grad, torch.full((2,), 4.0))  # divided by the swapped-in 2, not by 4
    assert _compat.grad_scaler_scale(scaler) is current and scaler.get_scale() == 4.0
