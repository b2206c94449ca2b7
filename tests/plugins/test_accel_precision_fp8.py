"""``AccelPrecision("fp8-mixed")`` in the Trainer: torchao's FP8 Linear layers (emulated on CPU), bf16 autocast for the
rest, fp32 master weights; with AccelDDP and AccelFSDP on real gloo processes, checkpoints and bad input.

The component itself (which layers convert, emulation, revert, accuracy against bf16) is tested in test_float8.py.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs
from tests.strategies.test_accel_fsdp import full_state

pytest.importorskip("torchao")

STEPS = 20


class _Wide(BNModel):
    """16 -> 32 -> 16 (both Linear layers FP8-eligible), plus ``odd``, a 16 -> 20 layer whose output is dropped."""

    def __init__(self, odd: bool = False) -> None:
        super().__init__(in_features=16, hidden=32, out_features=16, batchnorm=False, lr=0.05)
        self.odd = nn.Linear(16, 20) if odd else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 0.0 * self.odd(batch[0]).float().sum() if self.odd is not None else loss


def _fit(rank: int, world: int, strategy: Any, precision: str, batch: int, steps: int = STEPS, **kw: Any) -> dict:
    pl.seed_everything(0, verbose=False)
    model = kw.pop("model", None) or _Wide()
    plugins = [AccelPrecision(precision, **kw)] if precision != "32-true" else []  # fp32: Lightning's own plugin
    trainer_kwargs = small_trainer_kwargs(devices=world, max_steps=steps, max_epochs=-1, use_distributed_sampler=False)
    trainer = pl.Trainer(strategy=strategy, plugins=plugins, **trainer_kwargs)
    sampler = (rank, world) if world > 1 else (None, None)
    trainer.fit(model, make_loader(make_dataset(128, 16, 16), batch, *sampler))
    classes = {type(m).__name__ for m in model.modules()}
    return {"state": full_state(model), "classes": classes, "report": plugins[0].float8_report if plugins else None}


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_fp8_mixed_converts_reports_and_reverts_after_fit():
    run = _fit(0, 1, "auto", "fp8-mixed", 16, model=_Wide(odd=True), float8_filter=["net.3"])
    report = run["report"]
    assert report.converted == ("net.0",) and report.emulated  # CPU: emulated
    assert report.skipped == {"net.3": "excluded by module_filter", "odd": "out_features=20 is not a multiple of 16"}
    assert "Float8Linear" not in run["classes"] and "Linear" in run["classes"]  # the original classes again
    assert all(v.dtype == torch.float32 for v in run["state"].values())  # fp32 master weights
    assert set(run["state"]) == set(params_of(_Wide(odd=True)))


def _distributed(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{precision}/{name}": _fit(rank, world, cls(sync_batchnorm=False), precision, 8)
        for precision in ("fp8-mixed", "bf16-mixed")
        for name, cls in (("ddp", AccelDDP), ("fsdp", AccelFSDP))
    }


def test_fp8_under_ddp_and_fsdp_equals_one_process_on_the_joint_batch_within_fp8s_rounding():
    joint = {p: _fit(0, 1, "auto", p, 16)["state"] for p in ("fp8-mixed", "bf16-mixed", "32-true")}
    ranks = run_distributed(_distributed, 2, init_process_group=False, timeout=300)
    # FP8's own rounding on this run, and bf16's: the yardsticks of the tolerance
    fp8_rounding = _gap(joint["fp8-mixed"], joint["bf16-mixed"])
    bf16_rounding = _gap(joint["bf16-mixed"], joint["32-true"])
    assert fp8_rounding > bf16_rounding  # FP8 really quantizes
    for name in ranks[0]:
        state, precision = ranks[0][name]["state"], name.split("/")[0]
        assert _gap(state, ranks[1][name]["state"]) == 0.0  # ranks identical
        # Each rank scales its own half batch (tensorwise amax), so the split run rounds differently from the joint
        # one: within FP8's rounding of the run, where bf16 (which has no per-batch scales) agrees to its own.
        bound = 1.5 * fp8_rounding if precision == "fp8-mixed" else bf16_rounding
        assert _gap(state, joint[precision]) <= bound, name
    assert "Float8Linear" not in ranks[0]["fp8-mixed/ddp"]["classes"]
    moved = _gap(joint["fp8-mixed"], params_of(_untrained()))
    assert moved > 5 * fp8_rounding  # the weights trained further than the rounding moves them (about 10x)


def _untrained() -> nn.Module:
    pl.seed_everything(0, verbose=False)
    return _Wide()


def test_a_fp8_checkpoint_loads_into_the_plain_model_and_resumes_exactly(tmp_path):
    def trainer(steps: int) -> pl.Trainer:
        kwargs = small_trainer_kwargs(max_steps=steps, max_epochs=-1)
        # AccelDDP (one process) for its fix of resuming a checkpoint taken at the end of an epoch (#19617)
        return pl.Trainer(strategy=AccelDDP(sync_batchnorm=False), plugins=[AccelPrecision("fp8-mixed")], **kwargs)

    loader = make_loader(make_dataset(64, 16, 16), 16)  # 4 steps per epoch: the checkpoint at an epoch boundary
    pl.seed_everything(0, verbose=False)
    whole = _Wide()
    trainer(8).fit(whole, loader)
    pl.seed_everything(0, verbose=False)
    first = _Wide()
    half = trainer(4)
    half.fit(first, loader)
    half.save_checkpoint(tmp_path / "fp8.ckpt")
    saved = torch.load(tmp_path / "fp8.ckpt", weights_only=True)["state_dict"]
    plain = _Wide()
    plain.load_state_dict(saved)  # strict: the same keys as the plain model
    assert all(v.dtype == torch.float32 for v in saved.values())
    resumed = _Wide()
    trainer(8).fit(resumed, loader, ckpt_path=tmp_path / "fp8.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(params_of(resumed).values(), params_of(whole).values()))


def test_bad_fp8_settings_raise_before_training():
    with pytest.raises(ValueError, match=r"AccelPrecision\('bf16-mixed', float8=\.\.\.\).*Fix: pass precision='fp8"):
        AccelPrecision("bf16-mixed", float8=object())
    with pytest.raises(ValueError, match=r"float8_filter=\.\.\.\).*Fix"):
        AccelPrecision("16-mixed", float8_filter=["head"])
    untouched = _Wide()
    before = params_of(untouched)
    with pytest.raises(ValueError, match="'classifier' matches no module"):
        _fit(0, 1, "auto", "fp8-mixed", 16, model=untouched, float8_filter=["classifier"])
    assert all(torch.equal(before[k], v) for k, v in params_of(untouched).items())
    with pytest.raises(ValueError, match="no Linear layer"):
        _fit(0, 1, "auto", "fp8-mixed", 16, model=BNModel())  # 8 -> 16 -> 4: no dimension pair divisible by 16


def test_validation_and_validate_run_under_inference_mode():
    # Lightning evaluates under torch.inference_mode, where CPU autocast breaks torchao's float8 tensors (aten.to.dtype)
    model, loader = _untrained(), make_loader(make_dataset(64, 16, 16), 16)
    kwargs = {**small_trainer_kwargs(max_steps=2), "limit_val_batches": 2}
    trainer = pl.Trainer(plugins=[AccelPrecision("fp8-mixed")], **kwargs)
    trainer.fit(model, loader, loader)
    result = trainer.validate(model, loader)[0]
    assert math.isfinite(result["val_loss"])


def test_a_model_is_converted_once_and_its_linear_layers_come_back_at_teardown():
    plugin, model = AccelPrecision("fp8-mixed", device="cpu"), _untrained()
    linear = model.net[0]
    converted = plugin.convert_module(model)
    assert type(converted.net[0]).__name__ == "Float8Linear"
    assert plugin.convert_module(converted) is converted  # a strategy converting again (setup after a restart)
    plugin.teardown()
    assert converted.net[0] is linear
