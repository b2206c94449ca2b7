"""``lit_accel.plan``'s memory per rank against what the MemoryMonitor measures in the real run of each layout.

Issue #50: parameters, gradients, optimizer state and activations of the largest rank, each within 10%, for an MLP,
a GPT-style model, the ViT example's module and timm's and torchvision's ViTs, with and without activation
checkpointing. The MLP's widths are odd so that FSDP's dim-0 shards round up, as they do on real models.
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import MemoryMonitor, plan
from tests.examples._scripts import EXAMPLES, imported_example
from tests.helpers.distributed import run_distributed
from tests.helpers.gpt import GPT, token_dataset
from tests.helpers.models import small_trainer_kwargs
from tests.helpers.parallel import PipeModel, TimmViT, TorchvisionViT, dataset, image_dataset

KEYS = ("params_mb", "grads_mb", "optimizer_mb", "activations_mb")
LOADED = 8  # one device's loaded batch


def _model() -> PipeModel:
    return PipeModel(depth=4, width=63, hidden=252)


class _AdamModel(PipeModel):
    """AdamW (two moments and a step counter per parameter), not PipeModel's SGD with momentum."""

    def configure_optimizers(self) -> Any:
        return {"optimizer": torch.optim.AdamW(self.parameters(), lr=1e-3)}


def _measured(rank: int, world: int, layouts: list[str], make_model: Any, make_data: Any) -> dict[str, dict]:
    out = {}
    strategies = {row.name: row.strategy() for row in plan(make_model(), world_size=world, layouts=layouts).rows}
    for name in layouts:
        pl.seed_everything(0, verbose=False)
        monitor = MemoryMonitor(print_summary=False)
        trainer = pl.Trainer(**small_trainer_kwargs(devices=world, max_steps=2, callbacks=[monitor]),
                             strategy=strategies[name], use_distributed_sampler=False)  # fmt: skip
        trainer.fit(make_model(), DataLoader(make_data(64), batch_size=LOADED))
        out[name] = {key: monitor.summary[key] for key in KEYS}
    return out


def _assert_close(world: int, layouts: list[str], make_model: Any = _model, make_data: Any = dataset) -> None:
    planned = plan(make_model(), make_data(LOADED).tensors, world_size=world, layouts=layouts)
    # Spawned, as a launcher starts its ranks, for one process (a forked lone gloo rank hangs in DDP's first broadcast
    # once this process has run OpenMP) and for the libraries' ViTs, whose 2 to 4 ranks fit 5 to 7 layouts each: in CI
    # a forked rank of timm-2 stopped at tp2's first batch (the cause cut from the log) after 30 minutes of the slow
    # suite in its parent. Spawning costs ~15 s more per case; the other cases fork.
    start = "spawn" if world == 1 or make_model in (_timm_vit, _torchvision_vit) else "fork"
    measured = run_distributed(_measured, world, layouts, make_model, make_data, init_process_group=False,
                               timeout=300, start_method=start)[0]  # fmt: skip
    for name in layouts:
        predicted = planned[name].memory_mb
        for key in KEYS:
            assert predicted[key] == pytest.approx(measured[name][key], rel=0.1), (name, key, predicted, measured)
    sizes = {name: (planned[name].state_mb, planned[name].memory_mb["activations_mb"]) for name in layouts}
    assert len(set(sizes.values())) > 1, sizes  # the layouts differ: the comparison can tell them apart


def test_state_per_rank_equals_the_memory_monitors_on_two_processes():
    _assert_close(2, ["ddp", "fsdp", "fsdp+ac", "tp2", "pp2", "pp2+ac"])


def test_a_gpt_planned_equals_the_memory_monitors_with_and_without_activation_checkpointing():
    _assert_close(2, ["ddp", "fsdp", "fsdp+ac", "tp2", "tp2+ac", "pp2", "pp2+ac"], GPT, token_dataset)


def test_cpu_offload_keeps_the_state_the_monitor_measures_and_takes_it_off_a_gpus_peak():
    """On the CPU the offloaded state stays in the one memory: the rows equal the monitor's, the peak unchanged. On a
    GPU (``device="cuda"``, planned here, not run) the state moves to ``host_mb`` and out of the device's peak."""
    layouts = ["fsdp+offload", "fsdp+ac+offload", "pp2+offload"]
    _assert_close(2, layouts, GPT, token_dataset)
    batch = token_dataset(LOADED).tensors
    on_cpu = plan(GPT(), batch, world_size=2, layouts=["fsdp", *layouts])
    on_gpu = plan(GPT(), batch, world_size=2, device="cuda", layouts=["fsdp", *layouts])
    assert on_cpu["fsdp+offload"].peak_mb == on_cpu["fsdp"].peak_mb and on_cpu["fsdp+offload"].host_mb is None
    assert on_gpu["fsdp"].peak_mb == on_cpu["fsdp"].peak_mb and on_gpu["fsdp"].host_mb is None
    for name in layouts:
        row, parts = on_gpu[name], on_gpu[name].peak_parts_mb
        assert row.host_mb == pytest.approx(on_cpu[name].state_mb) and row.memory_mb == on_cpu[name].memory_mb
        state_on_cpu = on_cpu[name].memory_mb["params_mb"] + on_cpu[name].memory_mb["optimizer_mb"]
        assert parts["params"] == parts["optimizer"] == 0 and row.peak_mb <= on_cpu[name].peak_mb - state_on_cpu + 1e-9
    assert plan(GPT(), world_size=2, layouts=["ddp+offload"])["ddp+offload"].refused == (
        "'ddp+offload': AccelDDP has no CPU offload. Fix: 'fsdp+offload'."
    )


def _adam_model() -> _AdamModel:
    return _AdamModel(depth=4, width=63, hidden=252)


def test_adams_state_is_the_optimizers_own():
    _assert_close(2, ["ddp", "fsdp", "pp2"], _adam_model)


def _timm_vit() -> TimmViT:
    return TimmViT(depth=4, width=32, heads=4)


def _torchvision_vit() -> TorchvisionViT:
    return TorchvisionViT(depth=4, width=32, heads=4)


def _vit_example() -> pl.LightningModule:
    """``examples/vit.py``'s module as it builds it for the digits (timm's ViT at width 96, 4x4 patches, AdamW)."""
    with imported_example(EXAMPLES / "vit.py", "vit_example") as vit:
        net = vit.build_model(vit.DIGITS_MODEL, 10, 1, 16)
        return vit.ImageClassifier(net, 10, 2e-3, 0.05, None, input_shape=(1, 16, 16))


def _digits(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(10, (n,), generator=g))


# a stage's received input was booked as a parameter by the monitor: pipelines measured up to 14% short before
@pytest.mark.slow
@pytest.mark.parametrize(
    ("make_model", "make_data", "world", "layouts"),
    [
        (_model, dataset, 4, ["dp2xtp2", "pp2xdp2", "pp2xtp2", "tp4", "pp2xdp2+ac"]),
        (GPT, token_dataset, 4, ["dp2xtp2", "dp2xtp2+ac", "pp2xdp2", "pp2xdp2+ac", "pp2xtp2", "tp4", "pp4"]),
        (_vit_example, _digits, 1, ["ddp", "fsdp", "fsdp+ac"]),
        (_vit_example, _digits, 2, ["ddp", "fsdp", "fsdp+ac", "tp2", "tp2+ac"]),
        (_vit_example, _digits, 4, ["dp2xtp2", "dp2xtp2+ac", "tp4"]),
    ],
    ids=["mlp-4", "gpt-4", "vit_example-1", "vit_example-2", "vit_example-4"],
)
def test_state_per_rank_equals_the_memory_monitors_on_one_and_four_processes(make_model, make_data, world, layouts):
    _assert_close(world, layouts, make_model, make_data)


# timm's and torchvision's ViT on every kind of layout (torchvision's under a pipeline failed in torch's isend/irecv
# on a strided tensor before stages made what they exchange contiguous: nn.MultiheadAttention transposes)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("make_model", "world", "layouts"),
    [
        (_timm_vit, 2, ["ddp", "fsdp", "fsdp+ac", "fsdp+offload", "tp2", "pp2", "pp2+ac"]),
        (_timm_vit, 4, ["dp2xtp2", "dp2xtp2+ac", "pp2xdp2", "tp4", "pp4"]),
        (_torchvision_vit, 2, ["ddp", "fsdp", "fsdp+ac", "tp2", "pp2", "pp2+ac"]),
        (_torchvision_vit, 4, ["dp2xtp2", "pp2xdp2", "pp2xdp2+ac", "tp4", "pp4"]),
    ],
    ids=["timm-2", "timm-4", "torchvision-2", "torchvision-4"],
)
def test_a_libraries_vit_planned_equals_the_memory_monitors(make_model, world, layouts):
    _assert_close(world, layouts, make_model, image_dataset)


def test_every_layout_of_a_world_is_named_and_a_bad_one_refused_with_the_strategys_message():
    planned = plan(_model(), world_size=4)
    names = ["fsdp", "dp2xtp2", "tp4", "pp2xdp2", "pp2xtp2", "pp4"]
    expected = ["ddp", *[n for name in names for n in (name, name + "+ac")], "fsdp+offload", "fsdp+ac+offload"]
    assert [row.name for row in planned.rows] == expected
    assert all(row.refused is None for row in planned.rows)
    # checkpointing keeps the state and saves less for the backward
    checkpointed = planned["fsdp+ac"].memory_mb
    assert checkpointed["params_mb"] == planned["fsdp"].memory_mb["params_mb"]
    assert checkpointed["activations_mb"] is None  # no batch given
    with_batch = plan(_model(), dataset(LOADED).tensors, world_size=4, layouts=["fsdp", "fsdp+ac", "ddp+ac"])
    assert with_batch["fsdp+ac"].memory_mb["activations_mb"] < with_batch["fsdp"].memory_mb["activations_mb"] / 2
    assert "AccelDDP has no activation checkpointing" in with_batch["ddp+ac"].refused
    # a loaded batch the pipeline's micro-batches cannot split is refused as the strategy refuses it
    small = plan(_model(), dataset(2).tensors, world_size=4, layouts=["pp4"])["pp4"]
    assert "does not split into 8 equal micro-batches. Fix:" in small.refused and small.memory_mb == {}
    assert with_batch["fsdp+ac"].strategy().activation_checkpointing is True
    # DDP holds everything; FSDP a quarter; the state falls with every dimension
    ddp, fsdp = planned["ddp"].memory_mb, planned["fsdp"].memory_mb
    assert fsdp["params_mb"] == pytest.approx(ddp["params_mb"] / 4, rel=0.02)
    odd = plan(_model(), world_size=4, layouts=["pp3"])  # 3 stages do not divide 4 processes
    assert "multiple of 3" in odd["pp3"].refused and odd["pp3"].memory_mb == {}
    with pytest.raises(ValueError, match=r"layouts=\['zz2'\]\): not a layout name.*Fix"):
        plan(_model(), world_size=4, layouts=["zz2"])
    assert json.loads(planned.to_json())["rows"][0]["name"] == "ddp"
    assert "pp2xdp2" in str(planned) and planned.best is not None


def test_a_global_batch_is_each_layouts_accumulation_as_its_strategy_plans_it():
    layouts = ["ddp", "fsdp", "dp2xtp2", "tp4", "pp2xdp2", "pp4"]
    batch = dataset(LOADED).tensors
    planned = plan(_model(), batch, world_size=4, global_batch_size=64, layouts=layouts)
    # 64 samples a step over 4, 4, 2 and 1 data ranks loading 8 each
    accumulation = {name: planned[name].batch_plan.accumulate_grad_batches for name in layouts[:4]}
    assert accumulation == {"ddp": 2, "fsdp": 2, "dp2xtp2": 4, "tp4": 8}
    assert planned["tp4"].strategy().parts.global_batch_size == 64 and planned["ddp"].strategy().global_batch_size == 64
    # a pipeline takes no accumulation: refused with the loaded batch that makes the global one
    assert (
        "no accumulation. Fix: global_batch_size=16, or a train dataloader batch_size of 32."
        in planned["pp2xdp2"].refused
    )
    assert "Fix: global_batch_size=8, or a train dataloader batch_size of 64." in planned["pp4"].refused
    assert planned["pp4"].memory_mb == {}
    # accumulation keeps one loaded batch's activations; without a global batch each data rank loads one batch
    alone = plan(_model(), batch, world_size=4, layouts=["fsdp", "pp2xdp2"])
    assert alone["fsdp"].memory_mb == planned["fsdp"].memory_mb and alone["fsdp"].batch_plan.global_batch_size == 32
    assert alone["pp2xdp2"].batch_plan.micro_batches == 4 and "global_batch_size" not in alone["fsdp"].kwargs
    assert json.loads(alone.to_json())["rows"][1]["batch"] == alone["pp2xdp2"].batch_plan.describe()
    # a global batch no whole accumulation makes is refused with the strategy's message, before any work
    odd = plan(_model(), batch, world_size=4, global_batch_size=60, layouts=["ddp"])["ddp"]
    assert odd.refused.startswith("AccelDDP(global_batch_size=60) cannot be split") and "Fix:" in odd.refused
    with pytest.raises(ValueError, match=r"global_batch_size.*0.*Fix"):
        plan(_model(), batch, world_size=4, global_batch_size=0)


class _WeightedModel(PipeModel):
    """A batch of inputs, targets and a 0-dim loss weight: no one dim-0 size to split it by."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, weight = batch
        return self.pipeline_loss(self(x), y) * weight


def test_a_batch_without_one_dim_0_size_plans_unless_it_must_be_split():
    x, y = dataset(LOADED).tensors
    batch = (x, y, torch.tensor(0.5))
    planned = plan(_WeightedModel(depth=4, width=63, hidden=252), batch, world_size=2, layouts=["fsdp", "pp2"])
    assert planned["fsdp"].memory_mb["activations_mb"] > 0 and planned["fsdp"].batch_plan is None
    # a pipeline splits it into micro-batches, as a global batch would need its size: both refuse, naming the fix
    assert "dim-0 sizes ['0-dim', '8'] cannot be split" in planned["pp2"].refused and "Fix:" in planned["pp2"].refused
    with pytest.raises(ValueError, match=r"global_batch_size=32\): a batch of tensors with dim-0 sizes .*Fix"):
        plan(_WeightedModel(), batch, world_size=2, global_batch_size=32)


def test_offloaded_rows_without_a_batch_are_held_to_the_parameters_fsdp_gathers_on_the_gpu():
    tight = plan(_model(), world_size=4, device="cuda", memory_per_device=1.0, layouts=["fsdp", "fsdp+offload"])
    assert "the model state alone" in tight["fsdp"].refused
    assert "the gathered parameters alone" in tight["fsdp+offload"].refused and tight.best is None
    roomy = plan(_model(), world_size=4, device="cuda", memory_per_device=80e9, layouts=["fsdp+offload"])
    assert roomy["fsdp+offload"].fits is None and roomy["fsdp+offload"].host_mb == roomy["fsdp+offload"].state_mb
    # the table gains a host column where the state moved there
    assert "host" in str(roomy).splitlines()[2] and "host" not in str(plan(_model(), world_size=4, layouts=["fsdp"]))


def test_a_layout_whose_state_does_not_fit_is_refused_and_a_7b_model_plans_on_the_meta_device():
    with torch.device("meta"):
        model = PipeModel(depth=32, width=4096, hidden=7 * 4096)  # 7.5e9 parameters: nothing is allocated
    params = sum(p.numel() for p in model.parameters())
    planned = plan(model, world_size=64, layouts=["ddp", "fsdp", "pp2xtp2"], memory_per_device=80e9)
    # the closed form: fp32 parameters and gradients, SGD's momentum, divided by the shards
    assert planned["ddp"].memory_mb["params_mb"] == pytest.approx(params * 4 / 1e6, rel=1e-6)
    assert planned["ddp"].state_mb == pytest.approx(3 * params * 4 / 1e6, rel=1e-6)
    assert planned["fsdp"].memory_mb["params_mb"] == pytest.approx(params * 4 / 64 / 1e6, rel=1e-3)
    assert planned["ddp"].fits is False and "alone takes" in planned["ddp"].refused
    assert planned.best is not None and planned.best.name != "ddp"


class _ResidualModel(PipeModel):
    """A residual around the blocks, outside any unit: no pipeline can split it (the strategy refuses it at setup)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h + x))


def test_a_model_whose_forward_is_not_its_units_in_order_plans_no_pipeline_as_the_strategy_refuses_it():
    layouts = ["fsdp", "tp2", "pp2", "pp2+ac"]
    planned = plan(_ResidualModel(), dataset(LOADED).tensors, world_size=2, layouts=layouts)
    for name in ("pp2", "pp2+ac"):
        refused = planned[name].refused
        assert "forward is not its units applied in order" in refused and "Fix:" in refused
        assert "runs between units" in refused and planned[name].memory_mb == {}
    assert planned["fsdp"].refused is None and planned["tp2"].refused is None and planned.best is not None
    # the model that keeps the contract plans every layout
    assert all(row.refused is None for row in plan(_model(), world_size=2, layouts=layouts).rows)


def test_fp8_under_a_tensor_dimension_is_refused_as_the_strategy_refuses_it():
    planned = plan(_model(), world_size=2, precision="fp8-mixed", layouts=["fsdp", "tp2", "tp2+ac", "pp2"])
    for name in ("tp2", "tp2+ac"):
        assert "tensor_parallel=2) with fp8-mixed" in planned[name].refused and "Fix:" in planned[name].refused
    assert [row.name for row in planned.rows if row.refused is None] == ["fsdp", "pp2"]
    assert plan(_model(), world_size=2, precision="bf16-mixed", layouts=["tp2"])["tp2"].refused is None


def test_a_tensor_size_that_does_not_divide_the_heads_is_refused_naming_them():
    refused = plan(GPT(heads=4), world_size=8, layouts=["tp8"])["tp8"].refused
    assert "'blocks.0.attn' has n_head=4, not a multiple of tensor_parallel=8" in refused and "Fix:" in refused


def _gpt_for_the_peak() -> GPT:
    torch.manual_seed(0)
    return GPT(depth=2, width=64, heads=4)


def _tracked_peak(rank: int, world: int) -> float:
    """The tensor peak torch's MemTracker counts in a real step (its second: the optimizer's state in place)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, batch = _gpt_for_the_peak(), tuple(token_dataset(LOADED).tensors)
    optimizer = model.configure_optimizers()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):
            model.training_step(batch, 0).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    return float(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])


def test_the_peak_equals_the_tensor_peak_torch_tracks_in_a_real_step():
    """One process's step for real (torch's MemTracker counting every tensor alive: parameters, AdamW's state,
    activations, temporaries) peaks where the plan's fake step says; the runtime (kernels' scratch, the allocator)
    is not a tensor and not in either. The "fsdp" row of one process: gradients come with the backward, as here,
    and FSDP's unsharded copies of the parameters on top (over one rank it copies each into its unsharded buffer;
    the root and two blocks: the whole of this two-block model).
    (The real step runs in a child: tracked, it leaves autograd's threads behind, which a later fork cannot take.)"""
    row = plan(_gpt_for_the_peak(), tuple(token_dataset(LOADED).tensors), world_size=1, layouts=["fsdp"])["fsdp"]
    peak = run_distributed(_tracked_peak, 1, init_process_group=False)[0]
    gathered = row.peak_parts_mb["gathered"]
    assert (row.peak_mb - gathered) * 1e6 == pytest.approx(peak, rel=0.01), (row.peak_parts_mb, peak)
    assert gathered == pytest.approx(row.peak_parts_mb["params"], rel=1e-6)


def _backward_in_a_forked_child() -> str:
    import multiprocessing as mp

    def child(queue: Any) -> None:
        try:
            torch.set_num_threads(1)  # as Lightning's fork launcher does (the parent's OpenMP pool is not inherited)
            torch.ones(2, requires_grad=True).sum().backward()
            queue.put("ok")
        except RuntimeError as error:
            queue.put(str(error))

    context = mp.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    process.join(timeout=60)
    return queue.get(timeout=5)


def test_planning_leaves_this_process_able_to_fork_workers_that_train():
    """Fake tensors (they live on the meta device) leave autograd counting a device: the next backward here started
    its device threads, after which no forked child could run autograd (Lightning's fork start methods). The plan's
    fake work runs in a child of its own; this process trains and forks trainers after it."""
    planned = plan(_model(), dataset(LOADED).tensors, world_size=2, layouts=["fsdp"])
    assert planned["fsdp"].peak_parts_mb["temporaries"] > 0
    assert _backward_in_a_forked_child() == "ok"
    x, y = dataset(LOADED).tensors
    nn.functional.mse_loss(_model()(x), y).backward()  # a step here, as a notebook does before it forks trainers
    assert _backward_in_a_forked_child() == "ok"
