import pytest
import torch
from torch import nn

from lit_accel.callbacks._flops import FlopCounter, measure_flops

D_IN, D_HID = 1024, 4096


def _analytic_mlp_training_flops(batch: int) -> int:
    """Linear(1024, 4096) -> Linear(4096, 1024), forward + backward, from first principles.

    A Linear(i, o) on b samples is b*i*o multiply-accumulates (MACs); one MAC = 2 FLOPs.
    forward: 2 MACs-worth per layer; backward: a weight gradient per layer (same MACs) and an input gradient
    only where autograd needs one: layer 2's input (layer 1's output) yes, layer 1's input (the data) no.
    """
    macs_per_layer = batch * D_IN * D_HID  # both layers have in*out = 1024*4096
    forward = 2 * (2 * macs_per_layer)
    weight_grads = 2 * (2 * macs_per_layer)
    input_grads = 2 * macs_per_layer  # second layer only
    return forward + weight_grads + input_grads


@pytest.mark.parametrize("batch", [1, 3])
def test_mlp_forward_backward_flops_match_the_analytic_count(batch):
    mlp = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_IN))
    x = torch.randn(batch, D_IN)
    flops = measure_flops(lambda: mlp(x).pow(2).mean().backward())
    assert flops == _analytic_mlp_training_flops(batch)
    # per sample is batch-independent: 10 * 1024 * 4096
    assert flops / batch == 10 * D_IN * D_HID


def test_an_input_that_needs_grad_adds_the_first_layers_input_gradient():
    mlp = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_IN))
    x = torch.randn(2, D_IN, requires_grad=True)
    flops = measure_flops(lambda: mlp(x).sum().backward())
    assert flops == _analytic_mlp_training_flops(2) + 2 * (2 * D_IN * D_HID)


def test_counter_can_span_separate_calls_and_rejects_misuse():
    mlp = nn.Linear(8, 4)
    counter = FlopCounter()
    assert not counter.active
    counter.start()
    assert counter.active
    out = mlp(torch.randn(5, 8))  # started in one "hook" ...
    with pytest.raises(RuntimeError, match="twice"):
        counter.start()
    out.sum().backward()  # ... backward in another
    assert counter.stop() == 2 * 5 * 8 * 4 * 2  # forward + weight gradient, no input gradient
    assert not counter.active
    with pytest.raises(RuntimeError, match="without start"):
        counter.stop()
