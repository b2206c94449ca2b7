"""Float8Conversion: which layers convert, the emulation decision, exact revert, checkpoints, DDP/FSDP2, accuracy.

Everything runs on CPU with torchao's emulated FP8 matmuls (real float8 casts and scales, fp32 matmuls).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_accel.plugins.float8 import Float8Conversion, Float8Report, resolve_emulation
from tests.helpers.distributed import run_distributed


@pytest.fixture
def float8() -> Any:
    return pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'torchao>=0.10')")


def _net() -> nn.Sequential:
    """Two convertible layers, one with out_features=20, one with in_features=20, and a 16-wide head."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(32, 64),
            act=nn.GELU(),
            odd_out=nn.Linear(64, 20),
            odd_in=nn.Linear(20, 32),
            blocks=nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)),
            head=nn.Linear(32, 16),
        )
    )


def _float8_names(model: nn.Module, float8: Any) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)]


# ----------------------------------------------------------------------------------------------- emulation decision


@pytest.mark.parametrize(
    ("device_type", "capability", "emulate", "expected"),
    [
        ("cpu", None, None, True),  # no FP8 tensor cores: emulate automatically
        ("cpu", None, True, True),
        ("mps", None, None, True),
        ("cuda", (8, 9), None, False),  # Ada: tensor cores
        ("cuda", (9, 0), None, False),  # Hopper
        ("cuda", (10, 0), False, False),  # Blackwell, tensor cores required
        ("cuda", (9, 0), True, True),  # emulation can always be forced
        ("cuda", (8, 0), True, True),  # A100: only when asked for
        ("cuda", (8, 0), None, "compute capability 8.0"),
        ("cuda", (8, 6), False, "compute capability 8.6"),
        ("cuda", None, None, "compute capability unknown"),
        ("cpu", None, False, "emulate=False"),
    ],
)
def test_emulation_decision_table(
    device_type: str, capability: tuple[int, int] | None, emulate: bool | None, expected: bool | str
) -> None:
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected) as info:
            resolve_emulation(device_type, capability, emulate)
        assert " Fix: " in str(info.value)
    else:
        assert resolve_emulation(device_type, capability, emulate) is expected


def test_constructor_validation(float8: Any) -> None:
    with pytest.raises(TypeError, match=r"config=\{'emulate': True\}"):
        Float8Conversion(config={"emulate": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module_filter='head'"):
        Float8Conversion(module_filter="head")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every name must be a str"):
        Float8Conversion(module_filter=["head", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="emulate='yes'"):
        Float8Conversion(emulate="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config has emulate=True"):
        Float8Conversion(config=float8.Float8LinearConfig(emulate=True), emulate=False)
    # A config asking for emulation is an explicit request: honoured on GPUs without FP8 too.
    assert Float8Conversion(config=float8.Float8LinearConfig(emulate=True)).emulate is True
    with pytest.raises(RuntimeError, match="emulate=False"):
        Float8Conversion(emulate=False).apply(_net(), "cpu")


# ---------------------------------------------------------------------------------------------------------- report


def test_report_names_converted_and_skipped_layers(float8: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = _net()
    conversion = Float8Conversion(module_filter=["head"])
    with caplog.at_level("INFO"):
        out = conversion.apply(model, "cpu")
    assert out is model
    report = conversion.report
    assert isinstance(report, Float8Report)
    assert report.converted == ("fc1", "blocks.0", "blocks.2")
    assert dict(report.skipped) == {
        "odd_out": "out_features=20 is not a multiple of 16",
        "odd_in": "in_features=20 is not a multiple of 16",
        "head": "excluded by module_filter",
    }
    assert report.emulated and report.device_type == "cpu"
    assert _float8_names(model, float8) == ["fc1", "blocks.0", "blocks.2"]
    assert type(model.head) is nn.Linear and type(model.odd_out) is nn.Linear
    assert report.message.startswith(
        "FP8 (torchao, emulated on cpu: FP8 numerics, not FP8 speed): 3 of 6 Linear layers converted;"
    )
    assert "head (excluded by module_filter)" in report.message
    assert report.message in caplog.text
    assert all(m.config.emulate for m in model.modules() if isinstance(m, float8.float8_linear.Float8Linear))


def test_filter_callable_patterns_and_enclosing_modules(float8: Any) -> None:
    # torchao's contract: the callable returns True to convert.
    conversion = Float8Conversion(module_filter=lambda module, fqn: fqn != "head")
    conversion.apply(_net(), "cpu")
    assert conversion.report is not None and conversion.report.skipped["head"] == "excluded by module_filter"
    # An enclosing module's name leaves out everything inside it; fnmatch patterns work.
    cases = {
        ("blocks",): ("fc1", "head"),
        ("blocks.*", "fc?"): ("head",),
        ("blocks.2",): ("fc1", "blocks.0", "head"),
    }
    for names, converted in cases.items():
        conversion = Float8Conversion(module_filter=names)
        conversion.apply(_net(), "cpu")
        assert conversion.report is not None and conversion.report.converted == converted, names


def test_filter_name_matching_no_module_is_an_error(float8: Any) -> None:
    with pytest.raises(ValueError, match=r"'haed' matches no module of the model \(closest Linear layers: \['head'\]"):
        Float8Conversion(module_filter=["haed"]).apply(_net(), "cpu")


def test_no_eligible_layer_is_an_error_saying_why(float8: Any) -> None:
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 3))
    with pytest.raises(ValueError, match="no Linear layer") as info:
        Float8Conversion(module_filter=["2"]).apply(model, "cpu")
    message = str(info.value)
    assert "0: in_features=10 is not a multiple of 16" in message
    assert "2: excluded by module_filter" in message
    assert "3: out_features=3 is not a multiple of 16" in message
    assert " Fix: " in message
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))  # nothing converted
    with pytest.raises(ValueError, match=r"has no nn\.Linear layer"):
        Float8Conversion().apply(nn.Sequential(nn.Conv2d(3, 16, 3)), "cpu")


def test_layers_whose_forward_fp8_would_bypass_are_left_out(float8: Any) -> None:
    class LoRALinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Module()
    model.plain = nn.Linear(32, 32)
    model.custom = LoRALinear(32, 32)
    model.weight_norm = nn.utils.parametrizations.weight_norm(nn.Linear(32, 32))
    model.mha = nn.MultiheadAttention(32, 2)
    conversion = Float8Conversion()
    conversion.apply(model, "cpu")
    assert conversion.report is not None
    assert conversion.report.converted == ("plain",)
    assert dict(conversion.report.skipped) == {
        "custom": "LoRALinear overrides forward",
        "weight_norm": "parametrized (torch.nn.utils.parametrize)",
        "mha.out_proj": "inside nn.MultiheadAttention, which does not call its forward",
    }
    # Applying twice converts nothing more.
    with pytest.raises(ValueError, match="plain: already a Float8Linear"):
        conversion.apply(model, "cpu")


# ------------------------------------------------------------------------------------------------------ round trip


def _train_steps(model: nn.Module, steps: int = 3, seed: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(16, 32, generator=g)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_apply_revert_round_trip_and_checkpoint(float8: Any, tmp_path: Any) -> None:
    model = _net()
    originals = dict(model.named_modules())
    params = {name: p for name, p in model.named_parameters()}
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    originals["fc1"].note = "user attribute"
    calls: list[str] = []
    model.fc1.register_forward_hook(lambda m, i, o: calls.append("fwd"))
    x = torch.randn(4, 32)
    plain_out = model(x)
    calls.clear()

    conversion = Float8Conversion()
    conversion.apply(model, "cpu")
    assert _float8_names(model, float8) == ["fc1", "blocks.0", "blocks.2", "head"]
    converted_out = model(x)
    assert calls == ["fwd"], "a hook on the original Linear must keep firing while it is converted"
    # FP8 is really in use: close to the fp32 output, not equal.
    rel = ((converted_out - plain_out).norm() / plain_out.norm()).item()
    assert 0 < rel < 0.1
    assert {name: p for name, p in model.named_parameters()}.keys() == params.keys()
    assert all(p is params[name] for name, p in model.named_parameters())
    assert {k: v.dtype for k, v in model.state_dict().items()} == dtypes

    _train_steps(model)
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    assert conversion.revert(model) is model
    assert all(module is originals[name] for name, module in model.named_modules())
    assert type(model.fc1) is nn.Linear and model.fc1.note == "user attribute"
    assert all(p is params[name] for name, p in model.named_parameters())
    assert {k: v.dtype for k, v in model.state_dict().items()} == dtypes
    calls.clear()
    model(x)
    assert calls == ["fwd"]

    fresh = _net()
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, trained[key]) and torch.equal(value, model.state_dict()[key])


def test_linear_root_is_replaced_and_reverted(float8: Any) -> None:
    root = nn.Linear(32, 16)
    conversion = Float8Conversion()
    converted = conversion.apply(root, "cpu")
    assert isinstance(converted, float8.float8_linear.Float8Linear) and converted.weight is root.weight
    assert conversion.report is not None and conversion.report.converted == ("",)
    assert conversion.revert(converted) is root


def test_fsdp_float8_all_gather_weights_unwrap_for_state_dict_and_revert(float8: Any) -> None:
    model = _net()
    params = dict(model.named_parameters())
    conversion = Float8Conversion(config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    conversion.apply(model, "cpu")
    assert type(model.fc1.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    _train_steps(model)
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values()), "checkpoints must not need torchao to load"
    assert torch.equal(state["fc1.weight"], params["fc1.weight"])  # trained in place through the wrapper
    trained = {k: v.clone() for k, v in state.items()}
    model.load_state_dict(_net().state_dict())  # resuming from a plain checkpoint writes through the wrapper
    assert torch.equal(params["fc1.weight"], _net().fc1.weight)
    model.load_state_dict(trained)
    conversion.revert(model)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert not torch.equal(trained["fc1.weight"], _net().fc1.weight)


def test_gradients_are_fp32_and_the_found_inf_guard_skips(float8: Any) -> None:
    model = _net()
    Float8Conversion().apply(model, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)  # the bf16 guard: check, no scaling
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (False, True):
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(8, 32)
        if bad:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        grads = [model.fc1.weight.grad, model.blocks[0].weight.grad, model.head.bias.grad]
        assert all(type(g) is torch.Tensor and g.dtype == torch.float32 for g in grads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
        assert (not any(changed)) if bad else all(changed)


# ----------------------------------------------------------------------------------------------------- distributed


def _ddp_and_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig

    def train(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(3):
            model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    out: dict[str, Any] = {}
    conversion = Float8Conversion(module_filter=["odd_*"])
    model = conversion.apply(_net(), "cpu")  # convert, then wrap
    ddp = nn.parallel.DistributedDataParallel(model)
    try:
        Float8Conversion().apply(ddp, "cpu")
    except RuntimeError as err:
        out["wrapped_error"] = str(err)
    train(ddp)
    out["ddp"] = {k: v.clone() for k, v in conversion.revert(ddp.module).state_dict().items()}

    mesh = init_device_mesh("cpu", (world_size,))
    for all_gather in (False, True):
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
        model = Float8Conversion(config, module_filter=["odd_*"]).apply(_net(), "cpu")  # convert, then shard
        for layer in [*model.blocks, model.fc1, model.head]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[f"local_weight_{all_gather}"] = type(model.fc1.weight.to_local()).__name__
        train(model)
        out[f"fsdp2_{all_gather}"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    try:
        Float8Conversion().apply(model, "cpu")
    except RuntimeError as err:
        out["sharded_error"] = str(err)
    return out


def test_convert_then_ddp_or_fully_shard_with_float8_all_gather_on_gloo(float8: Any) -> None:
    results = run_distributed(_ddp_and_fsdp2, 2, timeout=180)
    for result in results:
        assert "convert first, then wrap or shard" in result["wrapped_error"]
        assert "convert first, then wrap or shard" in result["sharded_error"]
        assert result["local_weight_False"] == "Tensor"
        assert result["local_weight_True"] == "WeightWithDynamicFloat8CastTensor"
    ddp = results[0]["ddp"]
    assert not torch.equal(ddp["fc1.weight"], _net().fc1.weight)
    # With tensorwise scales from the whole weight, float8 all-gather casts exactly what DDP casts: equal results.
    for result in results:
        for key in ("ddp", "fsdp2_False", "fsdp2_True"):
            assert result[key].keys() == ddp.keys()
            assert all(torch.equal(result[key][k], ddp[k]) for k in ddp), key


# -------------------------------------------------------------------------------------------------------- accuracy


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    return torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16))


def _train_curve(
    make: Callable[[int], nn.Module],
    mode: str,
    seed: int,
    data: tuple[torch.Tensor, torch.Tensor],
    steps: int = 300,
    batch: int = 64,
    config: Any = None,
) -> tuple[float, float]:
    """(mean loss of the first 10 steps, mean loss of the last 50) of AdamW training in fp32, bf16 or fp8 + bf16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: as fast on one thread, and not slowed down by a busy second core
    try:
        return _train_curve_impl(make(seed), mode, seed, data, steps, batch, config)
    finally:
        torch.set_num_threads(threads)


def _train_curve_impl(
    model: nn.Module, mode: str, seed: int, data: Any, steps: int, batch: int, config: Any
) -> tuple[float, float]:
    if mode == "fp8":
        Float8Conversion(config).apply(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    x, y = data
    g = torch.Generator().manual_seed(1000 + seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
            loss = F.cross_entropy(model(x[idx]).float(), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    curve = torch.stack(losses)
    return curve[:10].mean().item(), curve[-50:].mean().item()


def _check_tracks_bf16(make: Callable[[int], nn.Module], data: Any, seeds: int, config: Any = None) -> dict[str, Any]:
    runs = {mode: _train_curve(make, mode, 0, data, config=config) for mode in ("fp32", "bf16", "fp8")}
    # The seed-to-seed spread of the final loss, from fp32 runs (bf16 is within 1e-4 of fp32 here, and 2-3x slower).
    fp32_seeds = [runs["fp32"][1]] + [_train_curve(make, "fp32", s, data)[1] for s in range(1, seeds)]
    (_, fp32), (first16, bf16), (first8, fp8) = runs["fp32"], runs["bf16"], runs["fp8"]
    numbers = {
        "fp32": fp32,
        "bf16": bf16,
        "fp8": fp8,
        "bf16_vs_fp32": abs(bf16 - fp32),
        "fp8_vs_bf16": abs(fp8 - bf16),
        "seed_sd": statistics.stdev(fp32_seeds),
        "drop_ratio": (first8 - fp8) / (first16 - bf16),
    }
    print(numbers)  # pytest -s shows the measurement
    # FP8 really quantizes: its effect exceeds bf16's (e4m3/e5m2 keep 3/2 mantissa bits, bf16 7)...
    assert numbers["fp8_vs_bf16"] > numbers["bf16_vs_fp32"], numbers
    # ...but changes the final loss less than half as much as another random seed does...
    assert numbers["fp8_vs_bf16"] <= 0.5 * numbers["seed_sd"], numbers
    # ...and FP8 learns: it removes at least 99% of the loss bf16 removes.
    assert numbers["drop_ratio"] >= 0.99, numbers
    return numbers


def test_fp8_mlp_training_tracks_bf16(float8: Any) -> None:
    _check_tracks_bf16(_mlp, _digits(), seeds=5)


@pytest.mark.slow
def test_fp8_rowwise_mlp_training_tracks_bf16(float8: Any) -> None:
    _check_tracks_bf16(_mlp, _digits(), seeds=5, config=float8.Float8LinearConfig.from_recipe_name("rowwise"))


def _digits_vit(seed: int) -> nn.Module:
    """A CIFAR-style ViT for 8x8 digits: 16 patches of 2x2, width 96, 4 blocks; every dim but the 10-class head's
    is a multiple of 16, so qkv, proj, fc1 and fc2 of each block convert (16 of 17 Linear layers)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=96, depth=4, num_heads=3
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 5 minutes alone: bf16 matmuls are slow on CPUs without AVX512-BF16
def test_fp8_vit_training_learns_as_much_as_bf16(float8: Any) -> None:
    x, y = _digits()
    data = (x.reshape(-1, 1, 8, 8) - 0.3, y)
    runs = {mode: _train_curve(_digits_vit, mode, 0, data) for mode in ("fp32", "bf16", "fp8")}
    (_, fp32), (first16, bf16), (first8, fp8) = runs["fp32"], runs["bf16"], runs["fp8"]
    numbers = {"fp32": fp32, "bf16": bf16, "fp8": fp8, "drop_ratio": (first8 - fp8) / (first16 - bf16)}
    print(numbers)
    # After 300 steps this ViT is far from converged and its final loss moves with the trajectory (on two seeds fp8
    # vs bf16 differed by -26% and +29%, bf16 vs fp32 by 16% and 2%: docs/precision.md), so
    # only learning is asserted: FP8 removes at least 90% of the loss bf16 removes.
    assert numbers["drop_ratio"] >= 0.9, numbers
