import pytest
import torch

from lit_accel.utilities._lagged_flags import LaggedFlags


def test_returns_the_oldest_set_flag_and_drops_clear_ones():
    flags = LaggedFlags()
    flag = torch.zeros(())
    flags.push(flag, "step 1")
    flag.fill_(1.0)  # the scaler updates its flag in place: the queued value must be a copy
    flags.push(flag, "step 2")
    flags.push(torch.ones(()), "step 3")
    assert flags.first_set() == "step 2"
    assert len(flags) == 1
    assert flags.first_set() == "step 3"
    assert flags.first_set() is None and len(flags) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flags_are_read_without_a_sync():
    values = [torch.tensor(float(step == 1), device="cuda") for step in range(3)]
    torch.cuda.synchronize()
    flags, seen = LaggedFlags(), []
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call below raises
    try:
        for step, value in enumerate(values):
            flags.push(value, step)
            seen.append(flags.first_set())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seen.append(flags.first_set(wait=True))
    assert [tag for tag in seen if tag is not None] == [1]
