"""AccelSyncBatchNorm: conversion round trip, process sub-groups, Lightning integration, property-based equivalence."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lit_accel.plugins.sync_batchnorm as sbn
from lit_accel.plugins._module_swap import swap_modules
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm, count_batchnorm_layers, is_synced_batchnorm
from lit_accel.plugins.sync_batchnorm import SyncBatchNorm
from tests.helpers import BNModel, make_dataset, make_loader, run_distributed, small_trainer_kwargs
from tests.helpers.parallel import full
from tests.helpers.torch_features import batchnorm
from tests.plugins.test_sync_batchnorm import check_joint_batch_equivalence


class TaggedBatchNorm(nn.BatchNorm2d):
    """A user subclass with an extra attribute and an extra buffer."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.tag = "keep me"
        self.register_buffer("extra", torch.arange(3.0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.BatchNorm1d(4)
        self.body = nn.Sequential(nn.Conv2d(2, 4, 1), TaggedBatchNorm(4), nn.ReLU())
        self.bn3d = nn.BatchNorm3d(2, momentum=None)
        self.no_bias = batchnorm(nn.BatchNorm1d, 4, bias=False)
        self.shared_a, self.shared_b = shared, shared
        self.already = SyncBatchNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h = self.body(x).mean(dim=(2, 3))
        h = self.shared_b(self.shared_a(h))
        h = self.already(self.no_bias(h))
        return self.head(h).sum() + self.bn3d(v).sum()


def _train_steps(model: Net, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x, v = torch.randn(6, 2, 3, 3, dtype=torch.float64), torch.randn(3, 2, 2, 2, 2, dtype=torch.float64)
        opt.zero_grad()
        model(x, v).backward()
        opt.step()


def test_apply_and_revert_round_trip_keeps_classes_objects_current_buffers_and_keys():
    model = Net()
    originals = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    plugin = AccelSyncBatchNorm()

    synced = plugin.apply(model)
    assert synced is model
    # body.1, bn3d, no_bias and the shared layer (once); the existing SyncBatchNorm is left alone.
    assert plugin.num_converted == 4 and plugin.resolved_implementation == "portable"
    assert count_batchnorm_layers(model) == 5
    assert all(type(m) is SyncBatchNorm for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert model.shared_a is model.shared_b
    assert model.already is originals["already"]
    assert dict(model.named_parameters()) == params  # the very same Parameter objects
    assert list(model.state_dict()) == keys
    assert model.body[1].extra is originals["body.1"].extra

    # Moving the model replaces the buffer tensors of the synced layers (dtype here: there is one device).
    model.double()
    _train_steps(model)
    current = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {name: b for name, b in model.named_buffers()}

    reverted = plugin.revert(model)
    assert reverted is model
    for name, original in originals.items():
        assert model.get_submodule(name) is original
    assert type(model.body[1]) is TaggedBatchNorm and model.body[1].tag == "keep me"
    assert type(model.bn3d) is nn.BatchNorm3d and type(model.no_bias) is nn.BatchNorm1d
    assert model.no_bias.bias is None
    assert model.shared_a is model.shared_b
    assert dict(model.named_parameters()) == params
    assert all(b is buffers[name] for name, b in model.named_buffers())  # the current tensors, not stale ones
    assert list(model.state_dict()) == keys
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, current[key], rtol=0, atol=0)
    assert model.bn3d.num_batches_tracked.item() == 2 and model.bn3d.running_var.dtype == torch.float64

    # A checkpoint of the synced model loads strictly into the plain model.
    fresh = Net().double()
    fresh.load_state_dict(current)
    # A BatchNorm root is replaced, and comes back.
    root = nn.BatchNorm1d(3)
    synced_root = plugin.apply(root)
    assert type(synced_root) is SyncBatchNorm and synced_root.weight is root.weight
    assert plugin.revert(synced_root) is root


def test_revert_restores_layers_converted_with_the_torch_implementation():
    # torch.nn.SyncBatchNorm can be built on CPU (only its distributed forward fails); select the implementation
    # directly, as apply() does after checking the device, to check revert() handles torch's class too.
    model = nn.Sequential(nn.Linear(3, 4), TaggedBatchNorm(4), nn.BatchNorm1d(4))
    bns = [model[1], model[2]]
    plugin = AccelSyncBatchNorm(implementation="torch")
    plugin.resolved_implementation = "torch"
    synced = swap_modules(model, plugin._to_sync)
    assert [type(m) for m in synced] == [nn.Linear, nn.SyncBatchNorm, nn.SyncBatchNorm]
    assert synced[1].weight is bns[0].weight
    with torch.no_grad():
        synced[2].running_mean = torch.full((4,), 3.0)  # replaced, as .to() would
    reverted = plugin.revert(synced)
    assert reverted[1] is bns[0] and reverted[2] is bns[1] and reverted[1].tag == "keep me"
    torch.testing.assert_close(reverted[2].running_mean, torch.full((4,), 3.0))


def test_count_batchnorm_layers():
    assert count_batchnorm_layers(Net()) == 5  # the shared layer counts once
    assert count_batchnorm_layers(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(group_size=0), ValueError, r"AccelSyncBatchNorm\(group_size=0\): expected an int >= 1 or None\. Fix"),
        (dict(group_size=-2), ValueError, r"group_size=-2\): expected an int >= 1 or None\. Fix: pass e\.g\. group"),
        (dict(group_size=2.0), TypeError, r"group_size=2.0\): expected an int >= 1 or None"),
        (dict(group_size=True), TypeError, r"group_size=True\): expected an int >= 1 or None"),
        (dict(implementation="fast"), ValueError, r"implementation='fast'\): expected one of 'auto', 'portable'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        AccelSyncBatchNorm(**kwargs)


def test_torch_implementation_on_cpu_explains_why_and_suggests_portable():
    with pytest.raises(ValueError, match=r"only runs on CUDA/XPU/HPU.*Use implementation='portable'"):
        AccelSyncBatchNorm(implementation="torch").apply(nn.Sequential(nn.BatchNorm1d(3)))


def test_group_size_must_divide_the_world_size():
    # No process group: a world of one process.
    with pytest.raises(ValueError, match=r"group_size=2\): the group size must divide the world size 1 .*: \[1\]"):
        AccelSyncBatchNorm(group_size=2).apply(nn.BatchNorm1d(3))


# ---------------------------------------------------------------------------------------------------------------------
# Process sub-groups


def _plugin_factory(group_size: int | None) -> Any:
    def make(ref: nn.Module) -> nn.Module:
        plugin = AccelSyncBatchNorm(group_size=group_size)
        synced = plugin.apply(ref)
        assert plugin.num_converted == 1
        return synced

    return make


def _groups_of(group_size: int | None) -> Any:
    """The process group AccelSyncBatchNorm gives this rank (it creates the groups: every rank, same order)."""
    plugin = AccelSyncBatchNorm(group_size=group_size)
    plugin.apply(nn.Identity())
    return plugin.process_group


def _two_rank_groups(rank: int, world_size: int) -> list[int]:
    calls: list[int] = []
    real = sbn._all_reduce_sum

    def counting(tensor: torch.Tensor, group: Any) -> None:
        calls.append(tensor.numel())
        real(tensor, group)

    sbn._all_reduce_sum = counting
    sizes, shape = (3, 5), (4, 3, 2)
    # group size 1: local BatchNorm, no collective
    check_joint_batch_equivalence(
        rank, sizes, shape, _plugin_factory(1), group_ranks=[rank], group=_groups_of(1), seed=1
    )
    local_calls = len(calls)
    # group size 2 = the world, and None = the world
    for seed, k in enumerate((2, None)):
        check_joint_batch_equivalence(rank, sizes, shape, _plugin_factory(k), group=_groups_of(k), seed=seed)
    sbn._all_reduce_sum = real
    return [local_calls, len(calls)]


def test_group_size_one_is_local_and_two_is_global_on_two_ranks():
    # the test's own all-reduce of weight/bias grads goes through torch.distributed directly, not counted: 3 steps
    # x (1 forward + 1 backward) x 2 runs of the global layer
    assert run_distributed(_two_rank_groups, 2) == [[0, 12], [0, 12]]


def _four_rank_pairs(rank: int, world_size: int) -> torch.Tensor:
    with pytest.raises(
        ValueError, match=r"group_size=3\): .*world size 4 .*Valid group sizes for world size 4: \[1, 2, 4\]"
    ):
        AccelSyncBatchNorm(group_size=3).apply(nn.BatchNorm1d(2))
    plugin = AccelSyncBatchNorm(group_size=2)
    layer = plugin.apply(nn.BatchNorm2d(3))
    assert dist.get_process_group_ranks(plugin.process_group) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    pair = [2 * (rank // 2), 2 * (rank // 2) + 1]
    check_joint_batch_equivalence(
        rank, (2, 3, 4, 1), (3, 2, 2), _plugin_factory(2), group_ranks=pair, group=plugin.process_group, seed=3
    )
    # Same input on every rank: the pairs see different joint batches, so their statistics differ.
    gen = torch.Generator().manual_seed(4)
    inputs = torch.randn(8, 3, 2, 2, generator=gen) * (1 + torch.arange(8.0).view(8, 1, 1, 1))
    layer(inputs[2 * rank : 2 * rank + 2])
    return layer.running_var.clone()


def test_group_size_two_on_four_ranks_syncs_pairs_only():
    stats = run_distributed(_four_rank_pairs, 4, timeout=60)
    torch.testing.assert_close(stats[0], stats[1], rtol=0, atol=0)
    torch.testing.assert_close(stats[2], stats[3], rtol=0, atol=0)
    assert (stats[0] - stats[2]).abs().min() > 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# Lightning: a real 2-process DDP fit with the plugin equals single-process training on the joint batch


def _fit(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    pl.seed_everything(0)
    model = BNModel()
    plugin = AccelSyncBatchNorm()
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size, strategy=DDPStrategy(), plugins=[plugin], max_steps=3, use_distributed_sampler=False
        )
    )
    trainer.fit(model, make_loader(make_dataset(48), 4, rank, world_size))
    return {
        "converted": plugin.num_converted,
        "bn_type": type(model.net[1]),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def test_lightning_ddp_fit_with_the_plugin_matches_single_process_training():
    results = run_distributed(_fit, 2, init_process_group=False)
    import lightning.pytorch as pl

    pl.seed_everything(0)
    ref = BNModel()
    opt = ref.configure_optimizers()
    data = make_dataset(48)
    for step in range(3):  # the two ranks' batches of 4 together are samples [8·step, 8·step + 8)
        x, y = data.tensors[0][8 * step : 8 * step + 8], data.tensors[1][8 * step : 8 * step + 8]
        opt.zero_grad()
        ref.training_step((x, y), step).backward()
        opt.step()
    for result in results:
        assert result["converted"] == 1 and result["bn_type"] is nn.BatchNorm1d  # reverted after fit
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-5, msg=key)


# ---------------------------------------------------------------------------------------------------------------------
# Property: over world sizes, per-rank batch sizes and group sizes, SyncBN == BN on each group's joint batch


def _property_case(rank: int, world_size: int, sizes: list[int], group_size: int, shape: tuple[int, ...]) -> None:
    first = group_size * (rank // group_size)
    check_joint_batch_equivalence(
        rank,
        sizes,
        shape,
        _plugin_factory(group_size),
        group_ranks=range(first, first + group_size),
        group=_groups_of(group_size),
        steps=2,
    )


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, list[int], int, tuple[int, ...]]:
    world_size = draw(st.integers(1, 4))
    group_size = draw(st.sampled_from([k for k in range(1, world_size + 1) if world_size % k == 0]))
    shape = draw(st.sampled_from([(3,), (2, 3), (2, 2, 2)]))
    values_per_sample = 1
    for d in shape[1:]:
        values_per_sample *= d
    sizes = draw(st.lists(st.integers(1, 5), min_size=world_size, max_size=world_size))
    for first in range(0, world_size, group_size):  # every group needs more than one value per channel
        if sum(sizes[first : first + group_size]) * values_per_sample < 2:
            sizes[first] = 2
    return world_size, sizes, group_size, shape


@settings(max_examples=8, deadline=None, database=None)
@given(case=_cases())
def test_property_sync_batchnorm_equals_batchnorm_on_each_groups_joint_batch(case):
    world_size, sizes, group_size, shape = case
    run_distributed(_property_case, world_size, sizes, group_size, shape, timeout=60)


# ---------------------------------------------------------------------------------------------------------------------
# A BatchNorm class with its own forward (timm's BatchNormAct2d: normalisation, then its drop and activation) is never
# replaced, which would drop the activation and train another model: its forward runs as written, with its
# training-mode F.batch_norm calls synchronised.


def _timm_lcnet() -> nn.Module:
    """timm's LCNet as timm builds it: every norm layer is a BatchNormAct2d."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("lcnet_050", num_classes=4)


def test_a_batchnorm_with_its_own_forward_keeps_its_class_and_forward_and_the_model_is_unchanged():
    import copy

    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.BatchNorm2d(3), _timm_lcnet())  # a stock BatchNorm in front: replaced
    reference = copy.deepcopy(model)
    acts = {name: m for name, m in model.named_modules() if isinstance(m, BatchNormAct2d)}
    plugin = AccelSyncBatchNorm()
    model = plugin.apply(model)
    assert isinstance(model[0], SyncBatchNorm) and len(acts) > 10
    assert plugin.num_converted == 1 + len(acts) and plugin.routed == list(acts)
    assert all(model.get_submodule(name) is layer and is_synced_batchnorm(layer) for name, layer in acts.items())
    x = torch.randn(4, 3, 32, 32)
    # one process: every layer is BatchNorm, so the model's outputs are the unchanged model's in training and eval
    # mode (replaced by a SyncBatchNorm, every activation of the network was gone)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model.eval(), reference.eval()
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model = plugin.revert(model)
    assert type(model[0]) is nn.BatchNorm2d
    assert not any(is_synced_batchnorm(m) or "forward" in vars(m) for m in model.modules())


def test_a_routed_layer_runs_and_gets_back_the_instance_forward_it_had():
    BatchNormAct2d = pytest.importorskip("timm.layers").BatchNormAct2d

    layer, calls = BatchNormAct2d(4), []

    def counted(x: torch.Tensor) -> torch.Tensor:  # a user's own instance forward (a wrapper, a compiled one)
        calls.append(x.shape[0])
        return BatchNormAct2d.forward(layer, x)

    layer.forward = counted
    model = AccelSyncBatchNorm().apply(nn.Sequential(layer))
    assert is_synced_batchnorm(layer)
    model(torch.randn(3, 4, 2, 2))
    assert calls == [3]  # the user's forward ran (inside the routing)
    AccelSyncBatchNorm().revert(model)
    assert layer.forward is counted and not is_synced_batchnorm(layer)


class _ManualBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass that normalises without F.batch_norm (nothing to synchronise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean(dim=(0, 2, 3), keepdim=True), x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps)


def _act_layer_joint_batch(rank: int, world_size: int) -> dict[str, Any]:
    import warnings

    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    ref = BatchNormAct2d(6, act_layer=nn.SiLU, momentum=None).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5), ref.bias.uniform_(-0.5, 0.5)
    layer = nn.Sequential(BatchNormAct2d(6, act_layer=nn.SiLU, momentum=None).double(), _ManualBatchNorm(6).double())
    layer[0].load_state_dict(ref.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = AccelSyncBatchNorm().apply(layer)
        for step in range(2):
            x = torch.randn(
                2 + 3 * world_size, 6, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
            )
            rows = slice(0, 2) if rank == 0 else slice(2, x.shape[0])  # uneven: rank 0 holds 2 rows, rank 1 holds 6
            mine = x[rows].clone().requires_grad_()
            out = layer[0](mine)
            layer[1](out)  # makes no F.batch_norm call: warned once, per-rank statistics
            weights = torch.linspace(-1, 1, x[0].numel(), dtype=torch.float64).view_as(x[0])
            (out * weights).sum().backward()
            joint = x.clone().requires_grad_()
            joint_out = ref(joint)
            (joint_out * weights).sum().backward()
            torch.testing.assert_close(out, joint_out[rows], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(mine.grad, joint.grad[rows], rtol=1e-10, atol=1e-10)
            grad = layer[0].weight.grad.clone()
            dist.all_reduce(grad)  # the layer's own gradients stay local (DDP sums them)
            torch.testing.assert_close(grad, ref.weight.grad, rtol=1e-10, atol=1e-10)
            layer[0].zero_grad(), ref.zero_grad()
    torch.testing.assert_close(layer[0].running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer[0].running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    return {"warnings": [str(w.message) for w in caught if "normalises without F.batch_norm" in str(w.message)]}


def test_a_batchnorm_act_layer_synchronised_equals_it_on_the_joint_batch():
    """Outputs, input and weight gradients and the running statistics (cumulative average) of timm's BatchNormAct2d
    on two uneven ranks equal the layer's on the joint batch; a subclass without F.batch_norm is named once."""
    pytest.importorskip("timm")
    results = run_distributed(_act_layer_joint_batch, 2)
    assert len(results[0]["warnings"]) == 1 and "'1' (_ManualBatchNorm)" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # rank 0 says it


class _TimmClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _timm_lcnet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _timm_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(48, 3, 32, 32, generator=generator), torch.randint(0, 4, (48,), generator=generator)
    )


def _fit_timm(rank: int, world_size: int, strategy: str) -> dict[str, torch.Tensor]:
    pl.seed_everything(0)
    model = _TimmClassifier()
    trainer = pl.Trainer(**small_trainer_kwargs(devices=world_size, strategy=strategy, max_steps=3,
                                                precision="64-true", use_distributed_sampler=False))  # fmt: skip
    trainer.fit(model, make_loader(_timm_data(), 4, rank, world_size))
    return {k: full(v) for k, v in model.state_dict().items()}  # (the sharded strategies' are DTensors)


@pytest.mark.parametrize("strategy", ["accel_ddp", "accel_fsdp", "accel_parallel"])
def test_a_timm_cnn_with_batchnorm_act_layers_trains_as_one_process_on_the_joint_batch(strategy):
    """The strategies' default SyncBatchNorm on timm's LCNet (BatchNormAct2d throughout): two ranks of 4 equal one
    process of 8 (before, the layers were replaced by SyncBatchNorm and the network lost its activations)."""
    results = run_distributed(_fit_timm, 2, strategy, init_process_group=False, timeout=180)
    pl.seed_everything(0)
    reference = _TimmClassifier().double()
    optimizer = reference.configure_optimizers()
    data = _timm_data()
    for step in range(3):
        x, y = data.tensors[0][8 * step : 8 * step + 8].double(), data.tensors[1][8 * step : 8 * step + 8]
        optimizer.zero_grad()
        reference.training_step((x, y), step).backward()
        optimizer.step()
    # float64: 27 BatchNorm layers over 4-sample batches amplify float32's rounding (1 step: 4e-5; 3 steps: 0.1); in
    # float64 the runs agree to 1e-9, and a wrong synchronisation is off by far more
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(results[0][key], value, rtol=1e-7, atol=1e-7, msg=key)
