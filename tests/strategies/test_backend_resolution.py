"""AccelFSDP(cpu_offload=True) on NCCL: the CPU collectives of offloaded gradients get a CPU backend at setup.

Offloaded gradients are CPU tensors; gradient clipping and the loss scaler's found-inf check all-reduce them over the
default group, and a plain ``"nccl"`` group carries no CPU tensor (the first optimizer step would fail). A GPU is not
needed to check the resolution: it depends on the rank's device and the spec only.
"""

from __future__ import annotations

import logging

import pytest
import torch

from lit_accel import AccelFSDP
from lit_accel.strategies.parts._backend import resolve_backend

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("spec", "device", "cpu_collectives", "expected"),
    [
        (None, CUDA, True, "cuda:nccl,cpu:gloo"),  # Lightning's default for CUDA is plain nccl
        ("nccl", CUDA, True, "cuda:nccl,cpu:gloo"),
        ("NCCL", CUDA, True, "cuda:nccl,cpu:gloo"),
        ("cuda:nccl", CUDA, True, "cuda:nccl,cpu:gloo"),
        ("cuda:nccl,cpu:gloo", CUDA, True, "cuda:nccl,cpu:gloo"),  # already carries CPU tensors: unchanged
        ("cpu:mpi,cuda:nccl", CUDA, True, "cpu:mpi,cuda:nccl"),  # the user's CPU backend is kept
        ("gloo", CUDA, True, "gloo"),  # gloo carries CPU and CUDA tensors
        (None, CUDA, False, None),  # no offload: Lightning's default stays
        ("nccl", CUDA, False, "nccl"),
        (None, torch.device("cpu"), True, None),  # a CPU rank: gloo by default, nothing to add
        ("gloo", torch.device("cpu"), True, "gloo"),
    ],
)
def test_cpu_collectives_on_a_gpu_rank_get_a_cpu_backend(spec, device, cpu_collectives, expected):
    assert resolve_backend("AccelFSDP", spec, device, cpu_collectives=cpu_collectives) == expected


def test_the_change_is_said_once_and_a_resolved_spec_stays(caplog):
    with caplog.at_level(logging.INFO):
        first = resolve_backend("AccelFSDP", None, CUDA, cpu_collectives=True)
        again = resolve_backend("AccelFSDP", first, CUDA, cpu_collectives=True)  # a second fit of the same strategy
    assert first == again == "cuda:nccl,cpu:gloo"
    said = [r.getMessage() for r in caplog.records if "cpu:gloo" in r.getMessage()]
    assert len(said) == 1 and "AccelFSDP: process_group_backend='cuda:nccl,cpu:gloo' (was None)" in said[0], said


def test_a_spec_that_cannot_carry_the_device_is_still_refused():
    with pytest.raises(ValueError, match=r"process_group_backend='nccl'\) needs CUDA devices.*Fix"):
        resolve_backend("AccelFSDP", "nccl", torch.device("cpu"), cpu_collectives=True)


def test_accel_fsdp_resolves_its_backend_from_cpu_offload_at_setup_environment(monkeypatch):
    """The strategy's own call: its backend before the process group starts (Lightning's _setup_distributed and the
    mesh stubbed out, so no group is created; the resolution and the mesh sizes are AccelFSDP's own code)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_accel.layout.mesh import ParallelLayout

    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(ParallelLayout, "build_mesh", lambda self, device_type: None)
    for offload, expected in ((True, "cuda:nccl,cpu:gloo"), (False, None)):
        strategy = AccelFSDP(cpu_offload=offload)
        strategy.parallel_devices = [CUDA]
        strategy.setup_environment()
        assert strategy.process_group_backend == expected
