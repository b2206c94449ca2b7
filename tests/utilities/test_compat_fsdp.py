"""The private torch/Lightning internals AccelFSDP relies on, through ``lit_accel.utilities._compat``: fail loudly."""

from __future__ import annotations

import inspect

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lit_accel.utilities import _compat


def test_fsdp_comm_interfaces_keep_the_signatures_the_counting_comms_implement():
    all_gather, reduce_scatter = _compat.fsdp_comm_base_classes()
    assert list(inspect.signature(all_gather.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "async_op"
    ]  # fmt: skip
    assert list(inspect.signature(reduce_scatter.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "op", "async_op"
    ]  # fmt: skip
    for cls in (all_gather, reduce_scatter):
        assert list(inspect.signature(cls.allocate).parameters) == ["self", "size", "dtype", "device"]


def test_composable_checkpoint_keeps_the_module_tree_and_the_gradients():
    checkpoint = _compat.composable_checkpoint()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    checked = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    checked.load_state_dict(plain.state_dict())
    checkpoint(checked)
    assert checked.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    checked(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checked.parameters()))


def test_model_parallel_strategy_still_reads_the_mesh_sizes_we_set():
    strategy = ModelParallelStrategy()
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == ("auto", "auto")
    _compat.set_model_parallel_sizes(strategy, 4, 1)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    source = inspect.getsource(ModelParallelStrategy.setup_environment)
    assert "self._data_parallel_size" in source and "self._tensor_parallel_size" in source


def test_lightning_helpers_materialize_move_and_launch():
    with torch.device("meta"):
        module = nn.Linear(2, 2)
    _compat.materialize_distributed_module(module, torch.device("cpu"))
    assert module.weight.device.type == "cpu"
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    _compat.optimizers_to_device([optimizer], torch.device("cpu"))
    assert optimizer.state[module.weight]["exp_avg"].device.type == "cpu"

    class _Strategy:
        cluster_environment, num_processes, num_nodes = None, 2, 1

    assert type(_compat.strategy_launcher(_Strategy(), "popen")).__name__ == "_SubprocessScriptLauncher"
    assert type(_compat.strategy_launcher(_Strategy(), "spawn")).__name__ == "_MultiProcessingLauncher"
