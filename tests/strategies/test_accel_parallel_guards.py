"""AccelParallel's guards: each refuses before the first optimizer step, naming the value and a fix.

Most at construction, the mesh when the world size is known, the model at setup, the micro-batches at fit start.

Plus a pin of torch's own failure that one guard exists for: a split-backward schedule over FSDP modules that reshard
after forward leaves the last stage without gradients. When a torch release fixes it, the pin fails: relax the guard.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_accel import AccelParallel, AccelPrecision, plan
from lit_accel.layout.schedules import SCHEDULES
from tests.helpers import run_distributed
from tests.helpers.models import small_trainer_kwargs
from tests.helpers.parallel import PipeModel, dataset

V_PROBLEM = SCHEDULES["zbv"].cpu_problem()  # why this torch cannot run the V schedules on CPU, or None


def _fit_until_refused(rank: int, world: int, strategy_kwargs: dict[str, Any], loaded: int = 8,
                       make_model: Any = PipeModel, precision: str | None = None) -> dict[str, Any]:  # fmt: skip
    plugins = [AccelPrecision(precision)] if precision else None
    trainer = pl.Trainer(strategy=AccelParallel(**strategy_kwargs), plugins=plugins,
                         **small_trainer_kwargs(devices=world, max_steps=2, max_epochs=-1))  # fmt: skip
    hook, printed = sys.excepthook, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(make_model(), DataLoader(dataset(32), batch_size=loaded))
            error = None
        except (ValueError, TypeError) as err:
            error = str(err)
            printed = _as_the_process_ends(err)
    sys.excepthook = hook
    return {"error": error, "steps": trainer.global_step, "warnings": [str(w.message) for w in caught],
            "printed": printed}  # fmt: skip


def _as_the_process_ends(error: BaseException) -> str:
    """What the interpreter prints for ``error`` uncaught (its excepthook, as the strategy's on_exception left it)."""
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        sys.excepthook(type(error), error, error.__traceback__)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = stderr


@pytest.mark.parametrize(
    ("world", "strategy_kwargs", "expected"),
    [
        (3, {"pipeline_parallel": 2}, "needs a world size that is a multiple of 2, got 3 processes"),
        (2, {"pipeline_parallel": 2, "stage_split": ["blocks.1", "blocks.3"]}, "names 2 stage start(s) for 2 stages"),
        (2, {"pipeline_parallel": 2, "stage_split": ["blocks.9"]}, "'blocks.9' is not a unit of the model"),
        (2, {"pipeline_parallel": 2, "microbatches": 3}, "does not split into 3 equal micro-batches"),
        (2, {"context_parallel": 2}, "no CPU kernel"),
        (2, {"pipeline_parallel": 2, "global_batch_size": 16}, "one loaded batch, so there is no accumulation"),
    ],
    ids=[
        "mesh",
        "split-count",
        "split-name",
        "uneven-microbatches",
        "context-parallel",
        "pipeline-accumulation",
    ],
)
def test_refused_before_the_first_step_with_a_fix(world, strategy_kwargs, expected):
    results = run_distributed(_fit_until_refused, world, strategy_kwargs, init_process_group=False)
    for result in results:
        assert result["error"] is not None and expected in result["error"], result["error"]
        assert "Fix:" in result["error"]
        assert result["steps"] == 0
    # said once (AccelParts' say_once, from on_exception): one line on rank 0 as the process ends, nothing elsewhere
    assert results[0]["printed"].count("\n") == 1 and expected in results[0]["printed"], results[0]["printed"]
    assert all(result["printed"] == "" for result in results[1:])


class _SelfSharded(PipeModel):
    """Shards a block itself in configure_model, as for Lightning's ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.blocks[0], mesh=self.device_mesh["data_parallel"])


def test_a_model_sharded_in_configure_model_is_refused_with_a_tensor_dimension():
    # without pipeline and tensor dimensions it is left as it is (test_accel_fsdp_features.py)
    for result in run_distributed(_fit_until_refused, 2, {"tensor_parallel": 2}, 8, _SelfSharded,
                                  init_process_group=False):  # fmt: skip
        assert "configure_model applied fully_shard" in result["error"] and "Fix: drop fully_shard" in result["error"]
        assert result["steps"] == 0


class _Loose(PipeModel):
    """A parameter of the LightningModule itself, in no unit: no stage or tensor-parallel FSDP group owns it."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift[: x.shape[-1]].sum()


@pytest.mark.parametrize(
    ("make_model", "precision", "expected"),
    [
        (PipeModel, "fp8-mixed", "(tensor_parallel=2) with fp8-mixed: float8 Linear layers need torchao's"),
        (_Loose, None, ": parameter 'shift' belongs to no module unit, so no stage or FSDP group can own it"),
    ],
    ids=["fp8", "loose-parameter"],
)
def test_the_plans_model_checks_refuse_at_setup_as_the_planner_refuses_the_row(make_model, precision, expected):
    results = run_distributed(_fit_until_refused, 2, {"tensor_parallel": 2}, 8, make_model, precision,
                              init_process_group=False)  # fmt: skip
    for result in results:
        assert result["error"].startswith("AccelParallel") and expected in result["error"], result["error"]
        assert "Fix:" in result["error"] and result["steps"] == 0
    planned = plan(make_model(), world_size=2, precision=precision or "32-true", layouts=["tp2", "fsdp"])
    assert planned["tp2"].refused == "lit_accel.plan" + results[0]["error"].removeprefix("AccelParallel")
    assert planned["fsdp"].refused is None  # without a pipeline or tensor dimension FSDP's root owns everything


class _Evaluated(PipeModel):
    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0])


def _evaluate_under_a_pipeline(rank: int, world: int, loop: str) -> str:
    trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=2), **small_trainer_kwargs(devices=world))
    try:
        getattr(trainer, loop)(_Evaluated(), DataLoader(dataset(16), batch_size=8))
    except ValueError as err:
        return str(err)
    return "ran"


@pytest.mark.parametrize("loop", ["test", "predict"])
def test_test_and_predict_under_a_pipeline_are_refused_before_any_batch(loop):
    for error in run_distributed(_evaluate_under_a_pipeline, 2, loop, init_process_group=False):
        assert f"cannot run trainer.{loop}() yet" in error and "Fix:" in error, error


def test_too_few_micro_batches_warn_with_the_bubble():
    results = run_distributed(_fit_until_refused, 2, {"pipeline_parallel": 2, "schedule": "gpipe", "microbatches": 1},
                              init_process_group=False)  # fmt: skip
    assert results[0]["error"] is None and results[0]["steps"] == 2
    bubble = [w for w in results[0]["warnings"] if "leaves each rank idle about 50%" in w]  # (p - 1) / (m + p - 1)
    assert bubble and "Fix:" in bubble[0]


def test_pipeline_without_a_declared_loss_is_refused():
    class NoLoss(PipeModel):
        pipeline_loss = None

    def fit(rank: int, world: int) -> str:
        trainer = pl.Trainer(strategy=AccelParallel(pipeline_parallel=2), **small_trainer_kwargs(devices=world))
        with pytest.raises(TypeError, match=r"needs NoLoss\.pipeline_loss") as info:
            trainer.fit(NoLoss(), DataLoader(dataset(32), batch_size=8))
        return str(info.value)

    assert all("Fix:" in message for message in run_distributed(fit, 2, init_process_group=False))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel": 0}, "pipeline_parallel=0"),
        ({"schedule": "1f2b"}, "schedule='1f2b'"),
        ({"schedule": "zbv", "stages_per_rank": 3}, "holds 2 stage(s) per rank"),
        ({"pipeline_parallel": 2, "schedule": "zero_bubble", "reshard_after_forward": True}, "split-backward"),
        ({"pipeline_parallel": 2, "schedule": "dualpipev", "reshard_after_forward": True}, "split-backward"),
        ({"pipeline_parallel": 2, "state_dict_type": "full"}, "state_dict_type='sharded'"),
        # a count the schedule refuses, known from the arguments alone (ParallelPlan.build): before any process starts
        ({"pipeline_parallel": 2, "schedule": "dualpipev", "microbatches": 2}, "DualPipeV needs at least"),
        ({"tensor_plan": {"fc": "diagonal"}}, "tensor_plan="),
        ({"stage_split": "blocks.2"}, "stage_split="),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises((ValueError, TypeError), match="Fix:") as info:
        AccelParallel(**kwargs)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------------- torch's failure


def _zero_bubble_with_resharding(rank: int, world: int, reshard: bool) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pipeline", "data"))
    pp = mesh["pipeline"].get_local_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    stages = []
    for index in (pp, pp + 2):  # interleaved: two stages per rank
        module = layers[index]
        fully_shard(module, mesh=mesh["data"], reshard_after_forward=reshard)
        stages.append(PipelineStage(module, index, 4, torch.device("cpu"), group=mesh["pipeline"].get_group()))
    schedule = ScheduleInterleavedZeroBubble(stages, 4, loss_fn=lambda out, y: (out - y).square().mean(),
                                             scale_grads=False)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    if pp == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])
    return [f"stage {s.stage_index}" for s in stages if any(p.grad is None for p in s.submod.parameters())]


def test_torch_zero_bubble_loses_gradients_when_fsdp_reshards_after_forward():
    # The reason for the split-backward guard (and for reshard_after_forward=False under a pipeline): if this starts to
    # pass with resharding, torch fixed it and the guard may go.
    missing = run_distributed(_zero_bubble_with_resharding, 4, True, timeout=120)
    assert any(missing), "torch's zero-bubble schedule now keeps every gradient with resharding: relax the guard"
    assert not any(run_distributed(_zero_bubble_with_resharding, 4, False, timeout=120))


def _raw_zbv(rank: int, world: int) -> str | None:
    """torch's ZBV schedule alone on gloo, as rank 1 of 2 (it holds the adjacent stages 1 and 2 of the V).

    Rank 1's first batch of sends includes one to itself; rank 0 stays out (it would wait for rank 1 forever), but
    alive until rank 1 is done: exiting earlier closes the connection and gloo reports that instead. A torch that fixed
    it makes rank 1 wait for rank 0 instead: the run then ends with another error, and the pin fails too.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    done = Path(tempfile.gettempdir()) / f"raw-zbv-{os.environ['MASTER_PORT']}"
    if rank == 0:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        done.unlink(missing_ok=True)
        return None
    layers = [nn.Linear(4, 4) for _ in range(4)]
    stages = [PipelineStage(layers[i], i, 4, torch.device("cpu")) for i in (1, 2)]
    schedule = ScheduleZBVZeroBubble(stages, 4, loss_fn=lambda out, y: (out - y).square().mean(), scale_grads=False)
    try:
        schedule.step()
    except RuntimeError as err:
        return str(err)
    finally:
        done.touch()
    return "ran"


@pytest.mark.skipif(V_PROBLEM is None, reason=f"torch {torch.__version__} runs the V schedules on gloo")
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_are_refused_on_cpu_where_torch_cannot_run_them(schedule):
    results = run_distributed(_fit_until_refused, 2, {"pipeline_parallel": 2, "schedule": schedule},
                              init_process_group=False)  # fmt: skip
    for result in results:
        assert f"schedule='{schedule}') on CPU: torch {torch.__version__} starts a V schedule" in result["error"]
        assert "Fix: upgrade torch" in result["error"] and result["steps"] == 0
    if schedule == "zbv":  # the pin: torch itself fails there. When this passes, lower V_ON_GLOO_SINCE to this torch.
        error = run_distributed(_raw_zbv, 2, timeout=120)[1]
        assert "Pair is not connected" in error, error
