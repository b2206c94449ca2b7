"""AccelParallel's guards: every configuration it cannot run is refused before the first step, with a fix.

At construction: the strategy's own arguments and their combinations with the plan (``ParallelPlan.build`` checks
the plan's). When the devices are known: what they cannot run. At setup: the model (a pipeline needs
``pipeline_loss``) and the precision. At fit start, when the loaded batch is known, ``_pipeline_batch`` checks the
micro-batch count for the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.trainer.states import TrainerFn

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.utilities._compat import get_layer_sync
from lit_accel.utilities._validation import check_choice, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_accel.layout.mesh import ParallelLayout
    from lit_accel.layout.plan import ParallelPlan

__all__ = ["check_arguments", "check_environment", "check_model"]


def check_arguments(
    owner: str, plan: ParallelPlan, *, micro_batch_size: object, state_dict_type: object, partial_window: object,
    start_method: object,
) -> None:  # fmt: skip
    """The constructor's arguments that are the strategy's, not the plan's, and their combinations with the plan."""
    if micro_batch_size != "auto":
        check_int(owner, "micro_batch_size", micro_batch_size, allow_none=True, example=4)
    check_choice(owner, "state_dict_type", state_dict_type, ("full", "sharded"), "'sharded'")
    check_choice(owner, "start_method", start_method, ("popen", "spawn", "fork", "forkserver"), "'popen'")
    pipeline = plan.layout.pipeline
    if pipeline > 1 and state_dict_type == "full":
        raise ValueError(
            f"{owner}(pipeline_parallel={pipeline}, state_dict_type='full'): a full checkpoint is gathered on rank 0,"
            " which holds one stage. Fix: state_dict_type='sharded' (it resumes under any layout)."
        )
    if pipeline > 1 and micro_batch_size == "auto":
        raise ValueError(
            f"{owner}(pipeline_parallel={pipeline}, micro_batch_size='auto'): a pipeline splits each loaded batch into"
            " the schedule's micro-batches itself; there is no accumulation to size. Fix: microbatches=N or"
            " micro_batch_size=N."
        )
    if pipeline > 1 and partial_window != "mean":
        raise ValueError(
            f"{owner}(partial_window={partial_window!r}) under a pipeline: every step is normalised over its"
            " own samples. Fix: partial_window='mean'."
        )


def check_environment(owner: str, plan: ParallelPlan, device: torch.device) -> None:
    """What only the devices decide: context parallel, a schedule this torch cannot run on CPU."""
    spec = plan.schedule
    problem = spec.cpu_problem() if plan.layout.pipeline > 1 and device.type == "cpu" else None
    if problem is not None:
        raise ValueError(
            f"{owner}(schedule={spec.name!r}) on CPU: {problem}. Fix: upgrade torch, run on GPUs, or choose"
            " schedule='interleaved_1f1b'."
        )
    cp = plan.context_parallel
    if cp > 1:
        reason = (
            "its attention backward has no CPU kernel (_scaled_dot_product_flash_attention_for_cpu_backward has no"
            " sharding strategy)"
            if device.type == "cpu"
            else "AccelParallel does not shard sequences yet"
        )
        raise ValueError(f"{owner}(context_parallel={cp}): {reason}. Fix: context_parallel=1.")


def check_model(owner: str, strategy: Any, module: pl.LightningModule, layout: ParallelLayout) -> None:
    """What the model and precision must offer for the layout (the plan's rules, which the planner runs too)."""
    precision = getattr(strategy.precision_plugin, "precision", None)
    strategy.plan.check_model(owner, module, precision)
    evaluating = module.trainer.state.fn
    if layout.pipeline > 1 and evaluating in (TrainerFn.TESTING, TrainerFn.PREDICTING):
        raise ValueError(
            f"{owner}(pipeline_parallel={layout.pipeline}) cannot run trainer.{evaluating.value}() yet: the test and"
            f" predict loops do not go through the pipeline schedule. Fix: run trainer.{evaluating.value}() in a"
            " Trainer whose strategy has no pipeline dimension (AccelParallel(pipeline_parallel=1), AccelFSDP)."
        )
    _check_layer_sync(owner, get_layer_sync(strategy), layout)
    if precision == "16-mixed" and not isinstance(
        getattr(strategy.precision_plugin, "scaler", None), torch.amp.GradScaler
    ):
        raise ValueError(
            f"{owner}: 16-mixed needs a loss scaler on the precision plugin. Fix: AccelPrecision('16-mixed')."
        )


def _check_layer_sync(owner: str, layer_sync: Any, layout: ParallelLayout) -> None:
    """A user's own LayerSync synchronises over the world: only where the data dimension is the world."""
    mixed = layout.pipeline > 1 or layout.tensor > 1
    if mixed and layer_sync is not None and not isinstance(layer_sync, (AccelSyncBatchNorm, TorchSyncBatchNorm)):
        raise ValueError(
            f"{owner}(pipeline_parallel={layout.pipeline}, tensor_parallel={layout.tensor}) with the LayerSync plugin"
            f" {type(layer_sync).__name__}, which synchronises over the world: a stage's and a tensor shard's peers"
            " would be mixed in. Fix: AccelSyncBatchNorm() (synchronised over the data dimension), or drop it."
        )
