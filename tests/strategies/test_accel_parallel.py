"""AccelParallel through ``Trainer.fit`` on real gloo processes: every layout and schedule equals one process.

For each layout (pipeline, data-sharded, tensor) and each schedule at pp2/pp4, the gradients of each of 3 optimizer
steps and the SGD-with-momentum parameters and momentum buffers after them equal a single process trained on the same
global batch (the union of the data-parallel ranks' batches) within 1e-6 in fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import run_distributed
from tests.helpers.parallel import (
    Block,
    PipeModel,
    TimmViT,
    TorchvisionViT,
    dataset,
    fit_parallel,
    fit_reference,
    image_dataset,
    merge,
)

ATOL = 1e-6
STEPS = 3


def assert_equivalent(strategy_kwargs: dict[str, Any], world: int, loaded: int, depth: int = 4, samples: int = 64,
                      reference_batch: int | None = None, compare_grads: bool = True, fit: Any = fit_parallel,
                      make_model: Any = PipeModel, make_data: Any = dataset, atol: float = ATOL,
                      shuffle_seed: int | None = None, **trainer_kwargs: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Run the layout and the one-process reference; assert gradients, parameters and momentum agree.

    ``compare_grads=False`` when clipping: Lightning's callbacks see the reference's gradients before it clips.
    ``fit``: ``fit_parallel`` or a function that calls it and adds to its result. ``shuffle_seed``: the reference's
    batches drawn as a seeded ``DistributedSampler`` shuffles (as Lightning's own sampler does in the layout).
    """
    make_model = functools.partial(make_model, depth=depth)
    replicas = world // (strategy_kwargs.get("pipeline_parallel", 1) * strategy_kwargs.get("tensor_parallel", 1))
    global_batch = reference_batch or loaded * replicas
    data = {"make_model": make_model, "make_data": make_data}
    reference = fit_reference(samples, global_batch, STEPS, **data, shuffle_seed=shuffle_seed, **trainer_kwargs)
    results = run_distributed(
        fit, world, strategy_kwargs, samples, loaded, STEPS, **data, init_process_group=False, timeout=300,
        **trainer_kwargs,
    )  # fmt: skip
    assert all(r["steps"] == STEPS for r in results)
    grads = merge(results, "grads")
    assert len(grads) == STEPS
    for step, (got, want) in enumerate(zip(grads, reference["grads"]) if compare_grads else ()):
        assert got.keys() == want.keys(), f"step {step}: gradients missing for {sorted(want.keys() - got.keys())}"
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=f"step {step} grad {name}")
    for key in ("params", "momentum"):
        got, want = merge(results, key), reference[key]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=f"{key} {name}")
    return results


def test_pipeline_of_two_equals_one_process():
    results = assert_equivalent({"pipeline_parallel": 2}, world=2, loaded=8)
    stage0 = set(results[0]["params"])
    assert "embed.weight" in stage0 and "head.weight" not in stage0  # each rank holds only its own stage
    # 4 micro-batches of 2 x 8 fp32 per step: stage 0 sends their activations, stage 1 their input gradients.
    for result in results:
        assert (result["comm"]["p2p_sends"], result["comm"]["p2p_bytes"]) == (4 * STEPS, 4 * STEPS * 2 * 8 * 4)


LAYOUTS = {
    "pp4": ({"pipeline_parallel": 4}, 4),
    "pp2xdp2": ({"pipeline_parallel": 2}, 4),
    "pp2xtp2": ({"pipeline_parallel": 2, "tensor_parallel": 2}, 4),
    "dp2xtp2": ({"tensor_parallel": 2}, 4),
    "pp2xdp2xtp2": ({"pipeline_parallel": 2, "tensor_parallel": 2}, 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(layout):
    strategy_kwargs, world = LAYOUTS[layout]
    assert_equivalent(strategy_kwargs, world, loaded=8)


@pytest.mark.parametrize("make_model", [TimmViT, TorchvisionViT], ids=["timm", "torchvision"])
def test_a_libraries_vit_with_its_units_is_its_own_forward(make_model):
    """The units a library's ViT gives the pipeline (docs/strategies.md: embedding and head folded into one unit
    each) are the library's model: its own forward on the same modules gives the same output, to the bit."""
    pl.seed_everything(0, verbose=False)
    model = make_model().eval()
    images = image_dataset(4).tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(model(images), model.vit_forward(images), atol=0, rtol=0)


# timm's VisionTransformer as its library defines it (tensor_plan="auto" splits each block's Mlp; its fused qkv
# attention stays replicated): issue #45's acceptance, within 1e-5 in fp32
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2xtp2", "pp2xdp2", "pp2xtp2"])
def test_timms_vit_in_a_layout_equals_one_process(layout):
    strategy_kwargs, world = LAYOUTS[layout]
    assert_equivalent(strategy_kwargs, world, loaded=4, depth=2, samples=32, make_model=TimmViT,
                      make_data=image_dataset, atol=1e-5)  # fmt: skip


# issue #49: two libraries' models (timm's VisionTransformer; torchvision's, whose nn.MultiheadAttention stays
# replicated while tensor_plan="auto" splits each MLPBlock) with Lightning's own DistributedSampler (shuffled, seed 0,
# over the data dimension): each step's batches together are the reference's shuffled global batch, within 1e-5
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2xtp2", "pp2xdp2"])
@pytest.mark.parametrize("make_model", [TimmViT, TorchvisionViT], ids=["timm", "torchvision"])
def test_a_libraries_vit_with_lightnings_own_sampler_equals_one_process(make_model, layout):
    strategy_kwargs, world = LAYOUTS[layout]
    assert_equivalent(strategy_kwargs, world, loaded=4, depth=2, samples=32, make_model=make_model,
                      make_data=image_dataset, atol=1e-5, shuffle_seed=0, use_distributed_sampler=True)  # fmt: skip


# What stages exchange is made contiguous: torchvision's nn.MultiheadAttention transposes, and torch sizes its receive
# buffers by the strides it saw, so this failed in isend/irecv ("input tensor has to be contiguous") before
@pytest.mark.slow
@pytest.mark.parametrize(("strategy_kwargs", "world"), [({"pipeline_parallel": 2}, 2), ({"pipeline_parallel": 4}, 4)],
                         ids=["pp2", "pp4"])  # fmt: skip
def test_torchvisions_vit_under_a_pipeline_over_one_data_rank_equals_one_process(strategy_kwargs, world):
    make_model = functools.partial(TorchvisionViT, width=32, heads=4)
    assert_equivalent(strategy_kwargs, world, loaded=8, depth=4, samples=32, make_model=make_model,
                      make_data=image_dataset, atol=1e-5)  # fmt: skip


def with_torch(schedule: str) -> Any:
    """The schedule as a test parameter, skipped on a torch without its class or unable to run it on CPU.

    AccelParallel refuses it there (``test_accel_parallel_guards.py``).
    """
    from torch.distributed import pipelining

    from lit_accel.layout.schedules import SCHEDULES

    spec = SCHEDULES[schedule]
    refused = not hasattr(pipelining, spec.torch_class) or spec.cpu_problem() is not None
    return pytest.param(schedule, marks=pytest.mark.skipif(refused, reason=f"torch {torch.__version__} cannot"))


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"]


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [2, 4])
@pytest.mark.parametrize("schedule", [with_torch(s) for s in SCHEDULES])
def test_schedule_equals_one_process(schedule, pipeline):
    # 8 blocks: enough for 2 stages per rank at pp4; 16 samples per step: 2 x 8 stages' micro-batches.
    assert_equivalent({"pipeline_parallel": pipeline, "schedule": schedule}, pipeline, loaded=16, depth=8)


class _SeesCompiled(pl.Callback):
    """Which of this rank's blocks run a compiled ``forward`` during the fit (the others are pruned stages)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.blocks = [block for block in module.blocks if isinstance(block, Block)]
        self.during = ["forward" in block.__dict__ for block in self.blocks]


def _fit_compiled(rank: int, world: int, strategy_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    from tests.strategies.test_compile import GRAPHS, counting_backend

    seen = _SeesCompiled()
    GRAPHS.clear()
    strategy_kwargs = {**strategy_kwargs, "compile": {"backend": counting_backend}}
    result = fit_parallel(rank, world, strategy_kwargs, *args, callbacks=[seen], **kwargs)
    after = ["forward" in block.__dict__ for block in seen.blocks]
    return {**result, "graphs": len(GRAPHS), "during": seen.during, "after": after}


@pytest.mark.parametrize(
    ("strategy_kwargs", "world"),
    [
        ({"pipeline_parallel": 2}, 2),
        pytest.param({"pipeline_parallel": 2, "tensor_parallel": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=["pp2", "pp2xtp2"],
)
def test_compiled_blocks_on_every_stage_equal_one_process(strategy_kwargs, world):
    # aot_eager through a counting backend (test_compile.py): each stage's blocks compiled after TP and before FSDP
    results = assert_equivalent(strategy_kwargs, world, loaded=8, fit=_fit_compiled)
    for result in results:
        assert result["graphs"] > 0 and result["during"] and all(result["during"]), result["during"]
        assert not any(result["after"])  # the eager forward back at teardown
