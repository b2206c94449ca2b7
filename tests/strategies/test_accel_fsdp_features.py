"""AccelFSDP's options on real gloo processes: memory 1/N, checkpoints, SyncBN, the policies, offload, precision."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision, DynamicGradScaler
from lit_accel.layout.blocks import find_blocks
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs
from tests.strategies.test_accel_fsdp import full_state

# ---------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"static_graph": True}, TypeError, r"AccelFSDP\(static_graph=...\) is a DDP argument.*Fix: drop it"),
        ({"comm_hook": "bf16"}, TypeError, r"comm_hook=...\) is a DDP argument"),
        ({"shard_polcy": "auto"}, TypeError, r"unknown argument\(s\) \['shard_polcy'\]"),
        ({"state_dict_type": "local"}, ValueError, r"state_dict_type='local'\): expected one of 'full', 'sharded'"),
        ({"shard_policy": "blocks"}, TypeError, r"shard_policy='blocks'\): expected 'auto', a module class"),
        ({"shard_policy": 0}, TypeError, r"shard_policy=0\)"),
        ({"reduce_dtype": "fp32"}, TypeError, r"reduce_dtype='fp32'\): expected a torch.dtype"),
        ({"cpu_offload": "yes"}, TypeError, r"cpu_offload='yes'\): expected True or False"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        AccelFSDP(**kwargs)


def test_policies_pick_the_blocks_of_a_vit_a_resnet_and_by_size():
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, embed_dim=64, num_heads=2)
    assert [type(b).__name__ for b in find_blocks("AccelFSDP", vit, "auto")] == ["Block"] * 3
    resnet = timm.create_model("resnet18", num_classes=10)
    assert {type(b).__name__ for b in find_blocks("AccelFSDP", resnet, "auto")} == {"BasicBlock"}
    # torchvision's ViT: the EncoderBlock, not the Linear its Sequential MLP repeats twice as often; and never the
    # out_proj of an nn.MultiheadAttention, which reads its weight without calling it (FSDP would never gather it)
    from torchvision.models import VisionTransformer

    tv = VisionTransformer(image_size=8, patch_size=4, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32)
    assert [type(b).__name__ for b in find_blocks("AccelFSDP", tv, "auto")] == ["EncoderBlock"] * 3
    linears = find_blocks("AccelFSDP", tv, nn.Linear)
    assert len(linears) == 3 * 2 + 1 and not any(isinstance(b, nn.modules.linear.NonDynamicallyQuantizableLinear)
                                                 for b in linears)  # fmt: skip
    sized = find_blocks("AccelFSDP", vit, 30_000)  # every smallest subtree with 30k free parameters
    assert sized and all(sum(p.numel() for p in b.parameters()) >= 30_000 for b in sized)
    assert find_blocks("AccelFSDP", vit, lambda m: isinstance(m, nn.LayerNorm))  # a callable
    with pytest.raises(ValueError, match=r"shard_policy=BatchNorm2d\): the model has no such module \(its repeated"):
        find_blocks("AccelFSDP", vit, nn.BatchNorm2d)


def test_the_strategy_is_registered_with_its_launch_variants():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="accel_fsdp", logger=False)
    assert isinstance(trainer.strategy, AccelFSDP)
    assert pl.strategies.StrategyRegistry.get("accel_fsdp_spawn")._start_method == "spawn"


# ---------------------------------------------------------------------------------------------- distributed runs


class _Wide(BNModel):
    """Wide enough that the per-rank state is dominated by evenly split matrices; AdamW for optimizer state."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__(in_features=64, hidden=256, out_features=64, optimizer="adamw", lr=1e-3, batchnorm=batchnorm)
        self.local_bytes = 0

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
        states = sum(local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)  # fmt: skip
        self.local_bytes = sum(local(p).numel() * p.element_size() for p in params) + grads + states


def _fit(rank: int, world: int, strategy: Any, model: nn.Module, steps: int = 3, **kwargs: Any) -> pl.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    kw = small_trainer_kwargs(devices=world, max_steps=steps, use_distributed_sampler=False, strategy=strategy)
    kw.update(kwargs)
    trainer = pl.Trainer(**kw)
    data = make_dataset(64, in_features=64, out_features=64) if isinstance(model, _Wide) else make_dataset(64)
    trainer.fit(model, make_loader(data, 4, rank, world), ckpt_path=ckpt_path)
    return trainer


def _fp16() -> AccelPrecision:
    return AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=2))


def _memory(rank: int, world: int) -> int:
    pl.seed_everything(0, verbose=False)
    model = _Wide()
    _fit(rank, world, AccelFSDP(), model, steps=2)
    return model.local_bytes


def test_per_rank_state_bytes_fall_as_one_over_n():
    one = run_distributed(_memory, 1, init_process_group=False, timeout=120)[0]
    assert one > 0
    for world in (2, 4):
        for local in run_distributed(_memory, world, init_process_group=False, timeout=180):
            assert abs(local / (one / world) - 1) < 0.10, (world, local, one)


def _checkpoints(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("full", "sharded"):
        pl.seed_everything(0, verbose=False)
        straight = BNModel(batchnorm=False, optimizer="adamw")
        plugin = _fp16()
        _fit(rank, world, AccelFSDP(state_dict_type=kind), straight, steps=12, plugins=[plugin])
        pl.seed_everything(0, verbose=False)
        first = BNModel(batchnorm=False, optimizer="adamw")
        # 8 batches per rank and epoch: the checkpoint is taken at the epoch's end (with max_steps, the case
        # Lightning alone resumes with a spurious batch: the AccelParts fix must reach FSDP too).
        trainer = _fit(rank, world, AccelFSDP(state_dict_type=kind), first, steps=8, plugins=[_fp16()])
        path = Path(tmp) / f"{kind}.ckpt"
        trainer.save_checkpoint(path)
        resumed = BNModel(batchnorm=False, optimizer="adamw")
        resumed_plugin = _fp16()
        _fit(rank, world, AccelFSDP(state_dict_type=kind), resumed, steps=12, plugins=[resumed_plugin], ckpt_path=path)
        out[kind] = {
            "straight": full_state(straight),
            "resumed": full_state(resumed),
            "scales": (plugin.loss_scale, resumed_plugin.loss_scale),
            "is_dir": path.is_dir(),
        }
    return out


def test_full_checkpoint_loads_into_the_plain_model_and_both_kinds_resume_exactly(tmp_path):
    ranks = run_distributed(_checkpoints, 2, str(tmp_path), init_process_group=False, timeout=240)
    for runs in ranks:
        for kind, run in runs.items():
            assert run["is_dir"] is (kind == "sharded")
            assert all(torch.equal(run["straight"][k], run["resumed"][k]) for k in run["straight"]), kind
            assert run["scales"][0] == run["scales"][1]  # the loss scale went through the checkpoint
    saved = torch.load(tmp_path / "full.ckpt", weights_only=True)
    plain = BNModel(batchnorm=False, optimizer="adamw")
    plain.load_state_dict(saved["state_dict"])  # strict: same keys, plain full tensors
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())
    assert "AccelPrecision" in saved and "MixedPrecision" in saved


def _syncbn(rank: int, world: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = BNModel()
    _fit(rank, world, AccelFSDP(), model, steps=2)
    assert type(model.net[1]) is nn.BatchNorm1d  # the original class is back after fit
    return full_state(model)


def test_syncbn_under_fsdp_equals_batchnorm_on_the_joint_batch():
    ranks = run_distributed(_syncbn, 2, init_process_group=False, timeout=120)
    pl.seed_everything(0, verbose=False)
    reference = BNModel()
    pl.Trainer(**small_trainer_kwargs(max_steps=2)).fit(reference, make_loader(make_dataset(64), 8))
    expected = params_of(reference)
    for state in ranks:
        for key in expected:
            assert torch.allclose(state[key], expected[key], atol=1e-5), key


class _SelfSharding(BNModel):
    """Shards itself in configure_model, as for Lightning's ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net[0], mesh=self.device_mesh["data_parallel"], reshard_after_forward=False)


def _options(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, kwargs in {
        "default": {},
        "zero2": {"reshard_after_forward": False},
        "checkpointing": {"activation_checkpointing": True},
        "offload": {"cpu_offload": True},
    }.items():
        pl.seed_everything(0, verbose=False)
        model = BNModel(batchnorm=False)
        _fit(rank, world, AccelFSDP(**kwargs), model, steps=3)
        out[name] = full_state(model)
    pl.seed_everything(0, verbose=False)
    strategy = AccelFSDP()
    _fit(rank, world, strategy, _SelfSharding(batchnorm=False), steps=1)
    out["self_sharded"] = strategy.sharded_modules  # empty: the strategy left the model's own sharding alone
    return out


def test_zero2_checkpointing_and_offload_train_the_same_and_self_sharded_models_are_respected():
    for runs in run_distributed(_options, 2, init_process_group=False, timeout=240):
        for name in ("zero2", "checkpointing", "offload"):
            for key, value in runs["default"].items():
                assert torch.allclose(runs[name][key], value, atol=1e-6), (name, key)
        assert runs["self_sharded"] == []


class _DtypeProbe(BNModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[torch.dtype] = []
        # Runs after FSDP's own pre-forward hook (registered with prepend=True), so it sees the gathered weight.
        self.net[0].register_forward_pre_hook(lambda module, args: self.seen.append(module.weight.dtype))


def _bf16(rank: int, world: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = _DtypeProbe(batchnorm=False)
    strategy = AccelFSDP()
    _fit(rank, world, strategy, model, steps=2, plugins=[AccelPrecision("bf16-mixed")])
    return {"forward": set(model.seen), "master": {p.dtype for p in model.parameters()}}


def test_bf16_computes_through_fsdps_mixed_precision_policy_with_fp32_master_shards():
    for run in run_distributed(_bf16, 2, init_process_group=False, timeout=120):
        assert run["forward"] == {torch.bfloat16} and run["master"] == {torch.float32}


def _min_scale(rank: int, world: int) -> dict[str, str]:
    messages = {}
    for name, strategy in (("fsdp", AccelFSDP()), ("ddp", AccelDDP())):
        scaler = DynamicGradScaler(init_scale=8.0, min_scale=1.0)

        class AlwaysInf(BNModel):
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return super().training_step(batch, batch_idx) * float("inf")

        try:
            _fit(
                rank,
                world,
                strategy,
                AlwaysInf(batchnorm=False),
                steps=20,
                plugins=[AccelPrecision("16-mixed", scaler=scaler)],
            )
        except RuntimeError as err:
            messages[name] = str(err)
    return messages


def test_the_min_scale_stop_comes_at_the_same_step_as_with_accel_ddp():
    for messages in run_distributed(_min_scale, 2, init_process_group=False, timeout=180):
        steps = {k: re.search(r"at optimizer step (\d+)", v).group(1) for k, v in messages.items()}
        assert steps == {"fsdp": "3", "ddp": "3"}  # 8 -> 4 -> 2 -> 1 at steps 0-2; step 3 overflows at the minimum
