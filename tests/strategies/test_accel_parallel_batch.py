"""AccelParallel's global-batch rule: exact short last batches and windows, one reduce-scatter per group per step.

The plan is resolved before ``configure_optimizers``: a OneCycleLR built from ``estimated_stepping_batches`` there
completes exactly, under a pipeline (one step per loaded batch) and without one (Lightning's accumulation).

Under a pipeline one optimizer step is one ``schedule.step()`` over the loaded batch; a short last batch of an epoch
runs with its own micro-batch count and is still the mean over its samples. Without a pipeline, Lightning's
accumulation with an exact partial last window. Either way FSDP reduce-scatters once per group per optimizer step,
counted by the strategy's comm stats.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lit_accel import AccelParallel, BatchPlan, HangWatchdog
from lit_accel.callbacks.hang_watchdog import REPORT_AFTER_S
from tests.helpers import lightning_info_messages, run_distributed, small_trainer_kwargs
from tests.helpers.parallel import PipeModel, dataset, fit_parallel
from tests.strategies.test_accel_parallel import assert_equivalent


def _one_reduce_scatter_per_group_per_step(results, steps):
    for result in results:
        groups = result["fsdp_groups"]
        assert groups > 0
        assert result["comm"]["rounds"] == steps
        assert result["comm"]["reduce_scatters"] == groups * steps, (result["comm"], groups)


def test_pipeline_short_last_batch_and_one_reduce_scatter_per_group_per_step():
    # pp2 x dp2: 18 samples per replica in loaded batches of 12 -> steps over 12, 6 (split into 3, not 4, micro-batches:
    # the divisor of 6 nearest 4) and 12 samples; the reference steps on the joint batches of 24, 12, 24.
    results = assert_equivalent({"pipeline_parallel": 2, "microbatches": 4}, world=4, loaded=12, samples=36)
    _one_reduce_scatter_per_group_per_step(results, steps=3)


@pytest.mark.slow
def test_interleaved_short_last_batch():
    results = assert_equivalent(
        {"pipeline_parallel": 2, "schedule": "interleaved_1f1b", "microbatches": 4}, world=4, loaded=12, samples=36
    )
    _one_reduce_scatter_per_group_per_step(results, steps=3)


@pytest.mark.slow
def test_accumulation_partial_window_without_pipeline():
    # dp2 x tp2, global batch 16 = 4 loaded x 2 accumulation x 2 replicas; 20 samples per replica -> windows 2, 2, 1.
    results = assert_equivalent(
        {"tensor_parallel": 2, "global_batch_size": 16}, world=4, loaded=4, samples=40, reference_batch=16
    )
    _one_reduce_scatter_per_group_per_step(results, steps=3)


# ------------------------------------------------------------------------------------------ the stepping estimate


class _OneCycle(PipeModel):
    """PipeModel stepping a OneCycleLR sized by ``estimated_stepping_batches`` (it raises when stepped past it)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        self.estimate = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.estimate)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# name -> (strategy arguments, loader batch, trainer arguments, steps, plan); 72 samples, 36 per data-parallel replica
# in loaded batches of 8, 8, 8, 8 and a short 4.
PLAN_CASES: dict[str, tuple[dict[str, Any], int, dict[str, Any], int, BatchPlan]] = {
    # one step per loaded batch, the short one too; 2 x 2 stages' micro-batches
    "pp2xdp2": ({"pipeline_parallel": 2}, 8, {}, 5, BatchPlan(16, 8, 2, 4, 1, 2)),
    "pp2xdp2_max_steps": ({"pipeline_parallel": 2, "global_batch_size": 16, "microbatches": 2, "hang_timeout": 300}, 8,
                          {"max_steps": 3, "max_epochs": 2}, 3, BatchPlan(16, 8, 4, 2, 1, 2)),
    # windows of 2, 2 and a partial 1 loaded batches per epoch
    "dp2xtp2": ({"tensor_parallel": 2, "global_batch_size": 32}, 8, {"max_epochs": 2}, 6, BatchPlan(32, 8, 8, 1, 2, 2)),
    "dp2xtp2_micro_max_steps": ({"tensor_parallel": 2, "global_batch_size": 32, "micro_batch_size": 4}, 8,
                                {"max_steps": 4, "max_epochs": 3}, 4, BatchPlan(32, 8, 4, 2, 2, 2)),
}  # fmt: skip


def _plan_fits(rank: int, world: int) -> dict[str, dict[str, Any]]:
    results = {}
    for name, (strategy_kwargs, batch, trainer_kwargs, _, _) in PLAN_CASES.items():
        pl.seed_everything(0, verbose=False)
        model, strategy = _OneCycle(), AccelParallel(**strategy_kwargs)
        kwargs = small_trainer_kwargs(devices=world, max_steps=-1, max_epochs=1)
        trainer = pl.Trainer(strategy=strategy, **{**kwargs, **trainer_kwargs})
        with lightning_info_messages() as messages:
            trainer.fit(model, DataLoader(dataset(72), batch_size=batch))
        watchdog = next(cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog))
        results[name] = {
            "estimate": model.estimate, "steps": trainer.global_step, "plan": strategy.batch_plan,
            "accumulation": trainer.accumulate_grad_batches, "watchdog": (watchdog.watchdog.on_hang, watchdog.timeout),
            "plan_lines": [m for m in messages if m.startswith("AccelParallel: global batch")],
        }  # fmt: skip
    return results


def test_the_stepping_estimate_in_configure_optimizers_is_the_number_of_steps_taken():
    runs = run_distributed(_plan_fits, 4, init_process_group=False, timeout=300)
    for rank, results in enumerate(runs):
        for name, result in results.items():
            strategy_kwargs, _, _, steps, plan = PLAN_CASES[name]
            assert (result["estimate"], result["steps"]) == (steps, steps), (name, result)
            assert result["plan"] == plan and result["accumulation"] == plan.accumulate_grad_batches, name
            assert len(result["plan_lines"]) == (1 if rank == 0 else 0), (name, result["plan_lines"])
            if rank == 0:
                assert result["plan_lines"][0].endswith(plan.describe()), name
            # the report-only watchdog by default; one that ends the job only when asked
            timeout = strategy_kwargs.get("hang_timeout")
            assert result["watchdog"] == (("report", REPORT_AFTER_S) if timeout is None else ("exit", timeout)), name


class _ForwardSizes(pl.Callback):
    """The batch size of every forward of the model in training."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.sizes: list[int] = []
        module.register_forward_pre_hook(lambda _, args: self.sizes.append(args[0].shape[0]))


def _fit_split(rank: int, world: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
    sizes = _ForwardSizes()
    return {**fit_parallel(rank, world, *args, callbacks=[sizes], **kwargs), "forward_sizes": sizes.sizes}


@pytest.mark.slow
def test_micro_batches_without_pipeline_equal_the_unsplit_run():
    # dp2 x tp2, global 16 = 4 loaded x 2 accumulation x 2 replicas, each loaded batch as 2 micro-batches of 2
    # (AccelParts' micro-batching: only the window's last backward reduces); 20 per replica -> windows 2, 2, 1.
    results = assert_equivalent({"tensor_parallel": 2, "global_batch_size": 16, "micro_batch_size": 2}, world=4,
                                loaded=4, samples=40, reference_batch=16, fit=_fit_split)  # fmt: skip
    _one_reduce_scatter_per_group_per_step(results, steps=3)
    assert all(r["forward_sizes"] == [2] * 10 for r in results), results[0]["forward_sizes"]  # 5 loaded batches
