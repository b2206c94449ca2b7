import pytest
import torch

from lit_accel.utilities._lagged_flags import LaggedFlags


def test_returns_the_oldest_set_flag_and_drops_clear_ones():
    flags = LaggedFlags(lag=0)
    flag = torch.zeros(())
    flags.push(flag, "step 1")
    flag.fill_(1.0)  # the scaler updates its flag in place: the queued value must be a copy
    flags.push(flag, "step 2")
    flags.push(torch.ones(()), "step 3")
    assert flags.first_set() == "step 2"
    assert len(flags) == 1
    assert flags.first_set() == "step 3"
    assert flags.first_set() is None and len(flags) == 0


def test_a_flag_is_read_exactly_lag_pushes_later_whatever_the_device_timing():
    # Ranks must raise at the same step: a set flag whose copy has landed is still not read before it is due.
    flags, seen = LaggedFlags(lag=1), []
    for step in range(4):
        flags.push(torch.tensor(float(step == 1)), step)
        seen.append(flags.first_set())
    assert seen == [None, None, 1, None]
    flags.push(torch.ones(()), 4)
    assert flags.first_set() is None  # step 3 was clear, step 4 not due yet
    assert flags.first_set(wait=True) == 4 and len(flags) == 0
    with pytest.raises(ValueError, match="lag=-1"):
        LaggedFlags(lag=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flags_are_pushed_and_read_without_a_sync():
    values = [torch.tensor(float(step == 1), device="cuda") for step in range(3)]
    torch.cuda.synchronize()
    flags = LaggedFlags(lag=1)
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call below raises
    try:
        for step, value in enumerate(values):
            flags.push(value, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the copies have landed, as they have `lag` steps later in training
    torch.cuda.set_sync_debug_mode("error")
    try:
        seen = [flags.first_set(), flags.first_set()]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert seen == [1, None]  # step 2 is not due yet
    assert flags.first_set(wait=True) is None and len(flags) == 0
