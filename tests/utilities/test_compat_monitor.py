"""The GradScaler accessors LossScaleMonitor relies on: fail loudly if torch moves the private attributes."""

import torch

from lit_accel.utilities._compat import grad_scaler_grads_unscaled, grad_scaler_scale


def _model_and_optimizer(fused: bool = False):
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


def test_grad_scaler_scale_is_lazy_and_is_the_live_tensor():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert grad_scaler_scale(scaler) is None  # created at the first scale()
    model, opt = _model_and_optimizer()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scale = grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.shape == () and scale.dtype == torch.float32
    assert scale.item() == scaler.get_scale() == 8.0
    model.weight.grad[0, 0] = float("inf")  # overflow: update() backs off in place, on the same tensor
    scaler.step(opt)
    scaler.update()
    assert grad_scaler_scale(scaler) is scale
    assert scale.item() == 8.0 * scaler.get_backoff_factor()


def test_grad_scaler_grads_unscaled_follows_the_optimizer_stage():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model, opt = _model_and_optimizer()
    assert not grad_scaler_grads_unscaled(scaler, opt)
    assert id(opt) not in scaler._per_optimizer_states  # the query must not create an entry in the defaultdict
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaled = model.weight.grad.clone()
    assert not grad_scaler_grads_unscaled(scaler, opt)
    scaler.unscale_(opt)
    assert grad_scaler_grads_unscaled(scaler, opt)
    torch.testing.assert_close(model.weight.grad * 4.0, scaled)
    scaler.step(opt)
    scaler.update()
    assert not grad_scaler_grads_unscaled(scaler, opt)  # update() resets the per-optimizer states


def test_fused_optimizer_keeps_scaled_grads_and_reports_so():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model, opt = _model_and_optimizer(fused=True)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)  # the fused optimizer takes grad_scale/found_inf itself; no unscale_ stage
    assert not grad_scaler_grads_unscaled(scaler, opt)
    scaler.update()


def test_disabled_scaler_has_no_scale():
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    _, opt = _model_and_optimizer()
    assert grad_scaler_scale(scaler) is None
    assert not grad_scaler_grads_unscaled(scaler, opt)
