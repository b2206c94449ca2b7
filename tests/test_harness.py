import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import lit_accel
from tests.helpers import (
    BNModel,
    DistributedTestError,
    make_dataset,
    make_loader,
    run_distributed,
    small_trainer_kwargs,
)


def _all_reduce_sum(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    # rank 0 blocks in a collective its peer never joins: the harness must not wait for gloo's timeout
    dist.all_reduce(torch.ones(1))


def _killed_on_rank_one(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does: the rank prints nothing
    dist.all_reduce(torch.ones(1))  # rank 0 fails here, a consequence


def _hang(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_public_api_is_reexported_from_the_package():
    core = {"AccelDDP", "AccelPrecision", "DynamicGradScaler", "EfficiencyMonitor", "LossScaleMonitor"}
    assert core <= set(lit_accel.__all__) and sorted(lit_accel.__all__) == list(lit_accel.__all__)
    for name in lit_accel.__all__:
        obj = getattr(lit_accel, name)
        assert obj.__module__.startswith("lit_accel.") and not obj.__module__.split(".")[-1].startswith("_"), name
    assert isinstance(lit_accel.__version__, str)


def test_two_process_all_reduce_gives_the_sum():
    assert run_distributed(_all_reduce_sum, 2) == [3.0, 3.0]


def test_three_processes_with_spawn():
    assert run_distributed(_all_reduce_sum, 3, start_method="spawn", timeout=120) == [6.0, 6.0, 6.0]


def test_failing_rank_fails_the_test_with_its_message_quickly():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="boom from rank one") as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert "rank 1 failed" in str(info.value)
    assert "ValueError" in str(info.value)
    assert time.monotonic() - start < 30


def test_a_rank_killed_by_a_signal_is_named_after_its_peers_consequence():
    """The cause ends the message, where a log cut in the middle still shows it."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_killed_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert message.rstrip().endswith("rank 1 was killed by SIGKILL (with no timeout passed here, usually the"
                                     " out-of-memory killer: see dmesg) without reporting (a crash prints its"
                                     " threads' stacks in pytest's 'Captured stderr')")  # fmt: skip
    assert "--- rank 0 failed ---" in message  # its peer's error, first, collected within the second it takes


def test_hung_group_fails_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish within 3s"):
        run_distributed(_hang, 2, timeout=3)
    assert time.monotonic() - start < 15


def _fit_ddp(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    pl.seed_everything(0)
    model = BNModel(batchnorm=False)
    trainer = pl.Trainer(
        **small_trainer_kwargs(devices=world_size, strategy=DDPStrategy(), max_steps=3, use_distributed_sampler=False)
    )
    trainer.fit(model, make_loader(make_dataset(48), 4, rank, world_size))
    assert trainer.world_size == world_size and trainer.global_rank == rank
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lightning_trainer_joins_the_harness_group():
    """A Trainer built inside a harness rank sees the external launch and keeps the ranks in step."""
    states = run_distributed(_fit_ddp, 2, init_process_group=False)
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
