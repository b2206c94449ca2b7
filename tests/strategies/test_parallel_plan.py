"""Issue #48: ``ParallelPlan`` resolves AccelParallel's layout once, for any world size, without processes.

What the plan infers (the data-sharded size, stages per rank, FSDP's reshard policy), what it refuses with the value
and the fix (sizes that do not divide the world, a schedule's fixed stage count, a micro-batch count the schedule
refuses), and its one-line description. The strategy builds it in its constructor (every refusal before the
processes start) and sizes it in ``setup_environment``; every AccelParallel test runs through it.
"""

from __future__ import annotations

import pytest

from lit_accel import AccelParallel, ParallelPlan


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16, 64, 128, 256, 512, 1000, 1024])
def test_the_data_sharded_size_is_what_the_other_sizes_leave_of_any_world(world):
    for pipeline, tensor, replicate in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 8, 2)]:
        given = pipeline * tensor * replicate
        if world % given:
            with pytest.raises(ValueError, match=rf"needs a world size that is a multiple of {given}, got {world}"):
                ParallelPlan.build("AccelParallel", world, pipeline_parallel=pipeline, tensor_parallel=tensor,
                                   data_replicate=replicate)  # fmt: skip
            continue
        plan = ParallelPlan.build("AccelParallel", world, pipeline_parallel=pipeline, tensor_parallel=tensor,
                                  data_replicate=replicate)  # fmt: skip
        layout = plan.layout
        assert layout.sizes == (pipeline, replicate, world // given, tensor)
        assert layout.world_size == world and layout.data == replicate * (world // given)
        assert plan.reshard_after_forward is (pipeline == 1)  # a pipeline keeps parameters from forward to backward
        assert plan.num_stages == (pipeline * 1 if pipeline == 1 else pipeline * plan.stages_per_rank)


def test_the_schedule_resolves_to_its_spec_and_its_stages_per_rank():
    plan = ParallelPlan.build("AccelParallel", 16, pipeline_parallel=2, tensor_parallel=2)
    assert plan.schedule.name == "1f1b" and plan.stages_per_rank == 1 and plan.num_stages == 2
    assert plan.describe() == "pipeline 2 x data 4 (sharded) x tensor 2 = 16 processes; schedule 1f1b, 2 stages"
    interleaved = ParallelPlan.build("AccelParallel", 8, pipeline_parallel=4, schedule="interleaved_1f1b")
    assert (interleaved.stages_per_rank, interleaved.num_stages) == (2, 8)  # the default of a looped schedule
    three = ParallelPlan.build("AccelParallel", 8, pipeline_parallel=2, schedule="interleaved_1f1b", stages_per_rank=3)
    assert three.num_stages == 6
    assert ParallelPlan.build("AccelParallel", 4, pipeline_parallel=2, schedule="zbv").stages_per_rank == 2  # V
    flat = ParallelPlan.build("AccelParallel", 4, tensor_parallel=2, data_replicate=2)
    assert flat.describe() == "pipeline 1 x data 2 (replicated) x 1 (sharded) x tensor 2 = 4 processes"
    assert ParallelPlan.build("AccelParallel", 2, pipeline_parallel=2, stage_split=["b"]).stage_split == ("b",)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "pipedream"}, ValueError, r"schedule='pipedream'\): expected one of .* Fix"),
        ({"pipeline_parallel": 2, "schedule": "zbv", "stages_per_rank": 3}, ValueError,
         r"schedule='zbv', stages_per_rank=3\): this schedule holds 2 stage\(s\) per rank\. Fix"),
        ({"pipeline_parallel": 4, "microbatches": 2}, ValueError,
         r"schedule='1f1b', microbatches=2\): 1F1B needs at least as many micro-batches as stages \(4\)\. Fix: more"),
        ({"pipeline_parallel": 0}, ValueError, r"pipeline_parallel=0\): expected an int >= 1\. Fix"),
        ({"tensor_parallel": 2.0}, TypeError, r"tensor_parallel=2\.0\): expected an int >= 1\. Fix"),
    ],
)  # fmt: skip
def test_a_plan_that_cannot_run_is_refused_naming_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelPlan.build("AccelParallel", 8, **kwargs)


def test_a_plan_sized_for_another_world_keeps_every_choice_and_refuses_what_does_not_divide():
    import torch

    plan = ParallelPlan.build("AccelParallel", None, pipeline_parallel=2, tensor_parallel=2, schedule="zbv",
                              microbatches=8, tensor_plan={"net.0": "colwise"},
                              reduce_dtype=torch.bfloat16)  # fmt: skip
    assert plan.layout.sizes == (2, 1, 1, 2)  # world None: the smallest world the sizes fit
    sized = plan.for_world("AccelParallel", 64, param_dtype=torch.bfloat16)
    assert sized.layout.sizes == (2, 1, 16, 2) and sized.param_dtype is torch.bfloat16
    kept = ("schedule", "stages_per_rank", "microbatches", "stage_split", "reshard_after_forward", "tensor_plan",
            "reduce_dtype", "context_parallel")  # fmt: skip
    assert all(getattr(sized, name) == getattr(plan, name) for name in kept)
    assert (sized.schedule.name, sized.num_stages, sized.reshard_after_forward) == ("zbv", 4, False)
    with pytest.raises(ValueError, match=r"multiple of 4, got 6 processes\. Fix: run 4 or 8 processes"):
        plan.for_world("AccelParallel", 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pipeline_parallel": 4, "microbatches": 2}, ValueError, r"microbatches=2\): 1F1B needs at least as many"),
        ({"pipeline_parallel": 2, "schedule": "zbv", "reshard_after_forward": True}, ValueError,
         r"schedule='zbv', reshard_after_forward=True\): split-backward schedules .* Fix"),
        ({"pipeline_parallel": 2, "schedule": "zbv", "activation_checkpointing": True}, ValueError,
         r"schedule='zbv', activation_checkpointing=True\): a split-backward schedule .* Fix"),
        ({"cpu_offload": 1}, TypeError, r"cpu_offload=1\): expected True or False\. Fix"),
        ({"activation_checkpointing": "blocks"}, TypeError, r"activation_checkpointing='blocks'\): expected .* Fix"),
        ({"pipeline_parallel": 2, "state_dict_type": "full"}, ValueError, r"state_dict_type='full'\): a full .* Fix"),
        ({"tensor_plan": {"net.0": "diagonal"}}, TypeError, r"tensor_plan=\{.net\.0.: .diagonal.\}\): expected .* Fix"),
        ({"stage_split": "net.2"}, TypeError, r"stage_split='net\.2'\): expected 'auto' or a list .* Fix"),
        ({"reduce_dtype": "bf16"}, TypeError, r"reduce_dtype='bf16'\): expected a torch\.dtype or None\. Fix"),
        ({"context_parallel": 0}, ValueError, r"context_parallel=0\): expected an int >= 1\. Fix"),
        ({"pipeline_parallel": 2, "micro_batch_size": "auto"}, ValueError, r"micro_batch_size='auto'\): a pipeline"),
        ({"micro_batch_size": "big"}, TypeError, r"micro_batch_size='big'\): expected an int"),
    ],
)  # fmt: skip
def test_the_strategy_refuses_at_construction_what_its_plan_or_it_cannot_run(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccelParallel(**kwargs)


def test_data_groups_are_the_ranks_of_one_pipeline_and_tensor_coordinate():
    plan = ParallelPlan.build("AccelParallel", 16, pipeline_parallel=2, tensor_parallel=2)  # data 4, tensor innermost
    assert plan.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert plan.data_groups(2) == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert ParallelPlan.build("AccelFSDP", 4).data_groups() == [[0, 1, 2, 3]]  # the whole world


def _fit_plan(rank: int, world: int) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from tests.helpers import small_trainer_kwargs
    from tests.helpers.parallel import PipeModel, dataset

    strategy = AccelParallel(pipeline_parallel=2, microbatches=4)
    trainer = pl.Trainer(strategy=strategy, **small_trainer_kwargs(devices=world, max_steps=1, max_epochs=-1))
    trainer.fit(PipeModel(), DataLoader(dataset(16), batch_size=8))
    return {"plan": strategy.plan.describe(), "layout": strategy.layout, "steps": trainer.global_step}


def test_the_strategy_reads_its_layout_from_the_plan_it_built():
    from tests.helpers import run_distributed

    before = AccelParallel(pipeline_parallel=2, microbatches=4).plan  # the smallest world these sizes fit
    assert before.describe() == "pipeline 2 x data 1 (sharded) x tensor 1 = 2 processes; schedule 1f1b, 2 stages"
    for result in run_distributed(_fit_plan, 2, init_process_group=False, timeout=120):
        assert result["plan"] == "pipeline 2 x data 1 (sharded) x tensor 1 = 2 processes; schedule 1f1b, 2 stages"
        assert result["layout"].sizes == (2, 1, 1, 1) and result["steps"] == 1


@pytest.mark.parametrize(
    ("world", "kwargs", "sharded"),
    [
        (1, {}, True),  # AccelFSDP's layout: FSDP even over one rank
        (4, {"pipeline_parallel": 2}, True),  # pp2 x dp2
        (2, {"pipeline_parallel": 2}, False),  # a pipeline over one data rank: nothing to shard
        (4, {"pipeline_parallel": 2, "tensor_parallel": 2}, True),  # every parameter a DTensor under TP
        (2, {"pipeline_parallel": 2, "cpu_offload": True}, True),  # offloading is FSDP's
    ],
)
def test_whether_the_model_is_sharded_is_the_plans_one_rule(world, kwargs, sharded):
    # the build (_build.py) and the planner (lit_accel.plan) both read it
    assert ParallelPlan.build("t", world, **kwargs).sharded is sharded
