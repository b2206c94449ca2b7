"""``compile=`` in AccelDDP and AccelFSDP: each block's forward compiled before the wrapping, training unchanged.

On 2 gloo processes, against the same run in eager mode: fp32 with accumulation, bf16-mixed and SyncBN. The default
suite compiles with ``aot_eager`` (dynamo's graph capture and AOTAutograd's joint graph, without inductor's C++
codegen, which takes ~30 s per graph on this CPU) through a counting backend, so the test proves graphs were captured
and run; the slow test runs inductor.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision
from lit_accel.strategies.parts._compile import compile_targets
from tests.helpers import BNModel, make_dataset, make_loader, run_distributed, small_trainer_kwargs
from tests.strategies.test_accel_fsdp import full_state

GRAPHS: list[int] = []


def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """``aot_eager``, counting every graph dynamo hands over."""
    from torch._dynamo.backends.debugging import aot_eager

    GRAPHS.append(len(gm.graph.nodes))
    return aot_eager(gm, example_inputs)


class _SeesCompiled(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.compiled = "forward" in pl_module.net.__dict__


def _fit(rank: int, world: int, strategy: Any, precision: str = "32-true", batchnorm: bool = False) -> dict:
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=batchnorm)
    seen = _SeesCompiled()
    kwargs = small_trainer_kwargs(devices=world, max_steps=4, max_epochs=-1, use_distributed_sampler=False)
    plugins = [AccelPrecision(precision)] if precision != "32-true" else []  # full precision: Lightning's own
    trainer = pl.Trainer(strategy=strategy, plugins=plugins, callbacks=[seen], **kwargs)
    GRAPHS.clear()
    trainer.fit(model, make_loader(make_dataset(64), 4, rank, world))
    return {"state": full_state(model), "graphs": len(GRAPHS), "during": seen.compiled,
            "after": "forward" in model.net.__dict__}  # fmt: skip


def _runs(rank: int, world: int) -> dict[str, Any]:
    compiled = {"backend": counting_backend}
    cases = {
        "ddp_acc": (AccelDDP, dict(global_batch_size=16), "32-true", False),  # accumulation 2: no_sync micro-batches
        "ddp_bf16": (AccelDDP, {}, "bf16-mixed", False),
        "ddp_syncbn": (AccelDDP, {}, "32-true", True),
        "fsdp_acc": (AccelFSDP, dict(global_batch_size=16), "32-true", False),
        "fsdp_bf16": (AccelFSDP, {}, "bf16-mixed", False),
    }
    out = {}
    for name, (cls, kwargs, precision, bn) in cases.items():
        out[name] = (_fit(rank, world, cls(compile=compiled, **kwargs), precision, bn),
                     _fit(rank, world, cls(**kwargs), precision, bn))  # fmt: skip
    return out


def test_compiled_blocks_train_as_eager_under_ddp_and_fsdp_with_accumulation_bf16_and_syncbn():
    for runs in run_distributed(_runs, 2, init_process_group=False, timeout=400):
        for name, (compiled, eager) in runs.items():
            assert compiled["graphs"] > 0 and eager["graphs"] == 0, name  # graphs captured, and only when asked
            under_fsdp = name.startswith("fsdp")  # FSDP compiles its shard blocks (the Linear layers here)
            assert compiled["during"] == (not under_fsdp) and not compiled["after"], name  # reverted at teardown
            # aot_eager runs the same aten ops in the same order: equal to fp32 round-off
            for key, value in compiled["state"].items():
                assert torch.allclose(value, eager["state"][key], atol=1e-6, rtol=0), (name, key)


def test_targets_are_repeated_composite_blocks_else_the_children():
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10, depth=3)
    assert [type(m).__name__ for m in compile_targets("AccelDDP", vit)] == ["Block"] * 3
    model = BNModel()
    assert compile_targets("AccelDDP", model) == [model.net]  # repeated Linear leaves would fuse nothing


def test_bad_compile_arguments_raise_at_construction():
    with pytest.raises(TypeError, match=r"AccelDDP\(compile='yes'\): expected a bool.*Fix: compile=True"):
        AccelDDP(compile="yes")
    with pytest.raises(ValueError, match=r"'modee' is no torch.compile argument. Fix: use some of fullgraph"):
        AccelFSDP(compile={"modee": "max-autotune"})


def _inductor(rank: int, world: int) -> dict[str, Any]:
    return {"compiled": _fit(rank, world, AccelDDP(global_batch_size=16, compile=True)),
            "eager": _fit(rank, world, AccelDDP(global_batch_size=16))}  # fmt: skip


@pytest.mark.slow
def test_inductor_compiled_blocks_train_as_eager():
    for runs in run_distributed(_inductor, 2, init_process_group=False, timeout=900):
        # inductor fuses and may reorder fp32 reductions: round-off of a few ulps per step, not more
        for key, value in runs["compiled"]["state"].items():
            assert torch.allclose(value, runs["eager"]["state"][key], atol=1e-5, rtol=0), key


def _fit_monitored(rank: int, world: int, model: pl.LightningModule | None = None) -> dict[str, Any]:
    import warnings

    from lit_accel import EfficiencyMonitor

    pl.seed_everything(0, verbose=False)
    monitor = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    kwargs = small_trainer_kwargs(devices=world, max_steps=4, max_epochs=-1, use_distributed_sampler=False)
    trainer = pl.Trainer(strategy=AccelDDP(compile={"backend": counting_backend}), callbacks=[monitor], **kwargs)
    GRAPHS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or BNModel(batchnorm=False), make_loader(make_dataset(64), 4, rank, world))
    eager = [str(w.message) for w in caught if "ran eagerly" in str(w.message)]
    return {"graphs": len(GRAPHS), "flops": monitor.flops_per_sample, "eager": eager}


def test_compiled_blocks_compile_under_the_efficiency_monitors_flop_count():
    """Issue #46: the monitor counts FLOPs under a dispatch mode over the first micro-batch, the compiled blocks' first
    call; torch 2.11-2.13's dynamo then marked them "run eagerly" for good (0 graphs). Runs in CI's floor step."""
    for result in run_distributed(_fit_monitored, 2, init_process_group=False, timeout=300):
        assert result["graphs"] > 0, result  # compiled after the counted micro-batch
        assert result["flops"] and result["flops"] > 0, result  # and the FLOPs were counted
        assert result["eager"] == [], result


class _EagerOnly(nn.Sequential):
    """A block torch.compile skips whole: its forward is ``torch.compiler.disable``d."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _fit_eager_only(rank: int, world: int) -> dict[str, Any]:
    model = BNModel(batchnorm=False)
    model.net = _EagerOnly(*model.net)
    return _fit_monitored(rank, world, model)


def test_a_block_that_never_compiles_is_named_once():
    """No silent eager fallback: after the second step, a block without compiled code is named, once, on rank 0."""
    results = run_distributed(_fit_eager_only, 2, init_process_group=False, timeout=300)
    assert results[0]["graphs"] == 0 and len(results[0]["eager"]) == 1, results[0]
    assert "AccelDDP(compile=...): _EagerOnly ran eagerly in the first 2 training steps" in results[0]["eager"][0]
    assert "Fix: TORCH_LOGS=graph_breaks" in results[0]["eager"][0]
    assert results[1]["eager"] == []  # rank 0 says it


def test_a_module_with_its_own_instance_forward_is_left_alone():
    model = nn.Sequential(nn.Linear(2, 2))
    own = model.forward
    model.forward = own  # type: ignore[method-assign]
    from lit_accel.strategies.parts._compile import ForwardCompilation

    compilation = ForwardCompilation("AccelDDP", {})
    compilation.apply([model])
    assert model.forward is own and compilation.modules == []
