import json
import pickle

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lit_accel.callbacks._flops import FlopCount, FlopCounter, measure_flops
from lit_accel.utilities._peak_flops import fp32_uses_tf32

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


# ----------------------------------------------------------------------------------------------- split by dtype
B, D_BODY, D_HEAD, D_OUT = 4, 32, 16, 8


class _MixedPrecisionNet(nn.Module):
    """A bf16-autocast body, an fp32 head and a float64 tail: each matmul's dtype is known by construction."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_BODY, 64), nn.ReLU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, D_HEAD)
        self.tail = nn.Linear(D_HEAD, D_OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.body(x)
        return self.tail(self.head(h.float()).double())


def _linear_training_flops(batch: int, d_in: int, d_out: int, input_grad: bool) -> int:
    # forward + weight gradient (+ input gradient when autograd needs one), 2 FLOPs per multiply-accumulate
    return (3 if input_grad else 2) * 2 * batch * d_in * d_out


def test_split_by_dtype_matches_the_analytic_count_of_each_part_and_the_modes_total():
    torch.manual_seed(0)
    net, x = _MixedPrecisionNet(), torch.randn(B, D_BODY)

    def step() -> None:
        net(x).sum().backward()

    count = measure_flops(step)
    # Backward runs in the forward's dtypes: autocast saved bf16 copies, so the body's gradients are bf16 matmuls.
    assert count.by_dtype == {
        "bf16": _linear_training_flops(B, D_BODY, 64, input_grad=False) + _linear_training_flops(B, 64, 64, True),
        "fp32": _linear_training_flops(B, 64, D_HEAD, input_grad=True),
        "fp64": _linear_training_flops(B, D_HEAD, D_OUT, input_grad=True),
    }
    with FlopCounterMode(display=False) as plain:  # upstream's own count of the same work
        step()
    assert count.total == count == plain.get_total_flops() == sum(count.by_dtype.values())


def test_convolutions_are_booked_in_their_autocast_dtype_and_fp32_stays_fp32_on_cpu():
    conv, x = nn.Conv2d(3, 8, 3), torch.randn(2, 3, 12, 12)

    def step(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = conv(x)
        y.float().sum().backward()

    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed: irrelevant on CPU, which has no TF32
        for autocast, key in ((True, "bf16"), (False, "fp32")):
            with FlopCounterMode(display=False) as plain:
                step(autocast)
            assert measure_flops(lambda a=autocast: step(a)).by_dtype == {key: plain.get_total_flops()}
    finally:
        torch.set_float32_matmul_precision(previous)


def test_a_float8_scaled_mm_is_booked_as_fp8():
    m, k, n = 16, 32, 48
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()  # _scaled_mm wants a column-major right operand
    one = torch.tensor(1.0)
    count = measure_flops(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    assert count.by_dtype == {"fp8": 2 * m * k * n}  # the float32 scales do not make it an fp32 matmul


@pytest.mark.parametrize(("emulate", "body"), [(False, "fp8"), (True, "fp32")])
def test_torchao_float8_linears_are_fp8_unless_emulated_which_runs_fp32_matmuls(emulate, body):
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False), nn.Linear(32, 16))
    # The head (net.2) stays in high precision, as torchtitan keeps its output layer.
    float8.convert_to_float8_training(
        net, config=float8.Float8LinearConfig(emulate=emulate), module_filter_fn=lambda _, fqn: fqn != "2"
    )
    x = torch.randn(B, 32)

    def step() -> None:
        net(x).sum().backward()

    count = measure_flops(step)
    # FlopCounterMode sees aten.mm on Float8TrainingTensor operands (inner data float8) either way; torchao's
    # backward computes the first layer's input gradient too, so every float8 linear costs 3 matmuls. Emulated (the
    # CPU default), torchao multiplies the dequantized values with an fp32 torch.mm: fp32 FLOPs at the fp32 rate.
    head = _linear_training_flops(B, 32, 16, input_grad=True)
    float8_linears = 3 * 2 * B * (32 * 64 + 64 * 32)
    expected = {"fp8": float8_linears, "fp32": head} if body == "fp8" else {"fp32": float8_linears + head}
    assert count.by_dtype == expected
    with FlopCounterMode(display=False) as plain:
        step()
    assert count == plain.get_total_flops()


def test_eager_cond_counts_the_costlier_branch_and_the_split_follows_the_total():
    x = torch.randn(8, 8)

    def run() -> None:  # the true branch has two matmuls, the false branch one; FlopCounterMode books the max
        torch.cond(x.sum() > 0, lambda t: (t @ t) @ t, lambda t: t @ t, (x,))

    with FlopCounterMode(display=False) as plain:
        run()
    count = measure_flops(run)
    assert count == plain.get_total_flops() == 2 * (2 * 8**3)
    assert count.by_dtype == {"fp32": count.total}


def test_flop_count_is_an_int_that_checks_its_split_and_pickles():
    count = FlopCount(10, {"bf16": 8, "fp32": 2})
    assert count == 10 and count / 4 == 2.5 and count > 0 and count.total == 10 and type(count.total) is int
    assert pickle.loads(pickle.dumps(count)).by_dtype == {"bf16": 8, "fp32": 2}
    assert json.dumps({"flops": count}) == '{"flops": 10}'
    with pytest.raises(ValueError, match=r"FlopCount\(total=10\): by_dtype=\{'bf16': 3\} sums to 3"):
        FlopCount(10, {"bf16": 3})


def test_a_second_count_starts_from_zero():
    lin, counter = nn.Linear(8, 4), FlopCounter()
    for _ in range(2):
        counter.start()
        lin(torch.randn(3, 8))
        assert counter.stop().by_dtype == {"fp32": 2 * 3 * 8 * 4}


def test_tf32_switches_are_read_from_either_api():
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision, conv.fp32_precision = "tf32", "ieee"  # the new API: the legacy getters would raise
        assert fp32_uses_tf32("matmul") and not fp32_uses_tf32("conv")
        matmul.fp32_precision, conv.fp32_precision = "ieee", "tf32"
        assert not fp32_uses_tf32("matmul") and fp32_uses_tf32("conv")
        matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision("high")  # the legacy API sets the same switch
        assert fp32_uses_tf32("matmul")
        torch.set_float32_matmul_precision("highest")
        assert not fp32_uses_tf32("matmul")
    finally:
        matmul.fp32_precision, conv.fp32_precision = before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 needs an NVIDIA GPU")
def test_fp32_matmuls_on_a_gpu_are_tf32_exactly_when_allowed():
    lin = nn.Linear(64, 64).cuda()
    x = torch.randn(8, 64, device="cuda")
    before = torch.backends.cuda.matmul.fp32_precision
    tf32 = torch.cuda.get_device_capability() >= (8, 0)
    try:
        for precision, key in (("tf32", "tf32" if tf32 else "fp32"), ("ieee", "fp32")):
            torch.backends.cuda.matmul.fp32_precision = precision
            assert set(measure_flops(lambda: lin(x).sum().backward()).by_dtype) == {key}
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
