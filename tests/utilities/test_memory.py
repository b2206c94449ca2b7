"""``utilities/_memory.py``: the optimizer state a first step allocates, peaks of a block, free memory (CPU here)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lit_accel import AccelDDP, AccelFSDP
from lit_accel.strategies.parts._micro_batches import MicroBatchHost
from lit_accel.utilities._memory import CudaMemory, PeakMemory, available_bytes, optimizer_state_bytes


def test_optimizer_state_is_found_on_meta_tensors_before_the_first_step():
    layer = nn.Linear(100, 100)
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert optimizer_state_bytes([torch.optim.SGD(layer.parameters(), lr=0.1)]) == 0
    assert optimizer_state_bytes([torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)]) == nbytes
    assert optimizer_state_bytes([torch.optim.AdamW(layer.parameters(), fused=True)]) == 2 * nbytes
    assert optimizer_state_bytes([torch.optim.LBFGS(layer.parameters())]) == 2 * nbytes  # unknown: Adam's two moments
    stepped = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 100)).sum().backward()
    stepped.step()
    assert optimizer_state_bytes([stepped]) == 0  # it exists already: nothing more to come
    assert all(p.device.type == "cpu" for p in layer.parameters())  # the real parameters were never touched


def test_peak_memory_sees_a_block_that_allocates_and_frees():
    peak = PeakMemory(torch.device("cpu"))
    assert PeakMemory.supported(torch.device("cpu"))
    with peak.measure():
        block = torch.ones(64 * 2**20 // 4)  # 64 MB, written
        del block
    assert 60 * 2**20 < peak.bytes < 80 * 2**20
    free = available_bytes(torch.device("cpu"), local_ranks=2)
    assert free is not None and free > 0


def test_both_strategies_are_micro_batch_hosts():
    for strategy in (AccelDDP(), AccelFSDP()):
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # (root_device needs the devices)
        assert isinstance(strategy, MicroBatchHost), type(strategy).__name__


GB = 10**9


def test_what_a_cuda_process_may_allocate_honours_its_fraction_and_other_processes():
    """Issue #46: the device's free memory is not all this process's (from given device figures)."""
    # an 80 GB device with 60 GB free; this process's tensors use 10 GB of the 12 GB its allocator holds
    alone = CudaMemory(free=60 * GB, total=80 * GB, reserved=12 * GB, allocated=10 * GB)
    assert alone.allocatable == 62 * GB  # free, plus the 2 GB cached unused
    # set_per_process_memory_fraction(0.5): the allocator reserves at most 40 GB, of which tensors use 10
    capped = CudaMemory(free=60 * GB, total=80 * GB, reserved=12 * GB, allocated=10 * GB, fraction=0.5)
    assert capped.allocatable == 30 * GB
    # other processes hold 63 GB more of the device: only 5 GB are free, whatever the fraction allows
    shared = CudaMemory(free=5 * GB, total=80 * GB, reserved=12 * GB, allocated=10 * GB, fraction=0.5)
    assert shared.allocatable == 7 * GB
    # a fraction already used up: nothing, never a negative size
    full = CudaMemory(free=60 * GB, total=80 * GB, reserved=12 * GB, allocated=10 * GB, fraction=0.1)
    assert full.allocatable == 0
