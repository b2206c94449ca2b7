"""AccelFSDP: sharded data parallel on FSDP2 (``fully_shard``) with every guarantee AccelDDP gives."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.strategies.parts import _blocks
from lit_accel.strategies.parts._backend import check_backend_spec, resolve_backend
from lit_accel.strategies.parts.accel_parts import AccelParts, register_names, serves_parts_attributes
from lit_accel.strategies.sharded import _fsdp_sharding as sharding
from lit_accel.strategies.sharded._fsdp_comm import (
    FSDPCommStats,
    GradientSync,
    gathered_attempts,
    install_counting_comms,
)
from lit_accel.strategies.sharded.plan import ParallelPlan
from lit_accel.utilities import _compat
from lit_accel.utilities._validation import check_bool, check_choice

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

    from lit_accel.protocols import CommStats

__all__ = ["AccelFSDP"]

_START_METHODS = {
    "accel_fsdp": "popen",
    "accel_fsdp_spawn": "spawn",
    "accel_fsdp_fork": "fork",
    "accel_fsdp_notebook": "fork",
}
_DDP_ONLY = ("static_graph", "find_unused_parameters", "gradient_as_bucket_view", "bucket_cap_mb", "comm_hook",
             "ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")  # fmt: skip


class _RootCalls(ModelParallelStrategy):
    """Every step through the root's ``__call__``, whose hooks gather the root's own parameters (a stem, a head).

    Lightning calls ``training_step`` directly; one calling ``self.net(x)`` rather than ``self(x)`` would skip them.
    """

    def _step(self, context: Callable[[], Any], name: str, args: tuple, kwargs: dict) -> Any:
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        with context():
            if isinstance(module, FSDPModule):  # the wrapper is the module itself: redirect through its hooks
                return self._forward_redirection(module, module, name, *args, **kwargs)
            return getattr(module, name)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self.precision_plugin.train_step_context, "training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self.precision_plugin.val_step_context, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self.precision_plugin.test_step_context, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(self.precision_plugin.predict_step_context, "predict_step", args, kwargs)


@serves_parts_attributes
class AccelFSDP(_RootCalls):
    """Fully sharded data parallel (FSDP2, ZeRO-3) with the global batch, exact windows, SyncBN and counted comms.

    Parameters, gradients and optimizer state are sharded over all ranks (``fully_shard`` on each block of the
    model, then the root), so each rank holds 1/N of them. With ``AccelPrecision("bf16-mixed"|"16-mixed")`` the
    blocks compute in bf16/fp16 through FSDP2's ``MixedPrecisionPolicy`` (fp32 master shards, gradients reduced in
    ``reduce_dtype``); fp16 loss scaling skips a step on every rank when any rank's shard overflows. Non-final
    micro-batches skip the reduce-scatter. A model whose ``configure_model`` shards itself (as for Lightning's
    ``ModelParallelStrategy``, with ``self.device_mesh``) is left as it is. Details: ``docs/strategies.md``.

    Args:
        process_group_backend, timeout, start_method: as for ``AccelDDP``.
        global_batch_size, micro_batch_size, partial_window, sync_batchnorm, hang_timeout: as for ``AccelDDP``.
        compile: as for ``AccelDDP``; each shard block is compiled before ``fully_shard``.
        shard_policy: the blocks to shard: ``"auto"`` (the model's repeated block class), a class or tuple of
            classes, a minimum parameter count, or a callable ``module -> bool``.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3, default) or keep them to backward
            (ZeRO-2 style: less communication, more memory).
        reduce_dtype: dtype of the gradient reduce-scatter under mixed precision (``None``: the compute dtype).
        cpu_offload: keep parameters, gradients and optimizer state on the CPU (the optimizer steps there).
        activation_checkpointing: recompute each block's activations in backward: ``True`` (the sharded blocks), or
            a policy like ``shard_policy``.
        state_dict_type: ``"full"`` (one file of plain tensors, loadable into the unsharded model) or ``"sharded"``
            (a distributed-checkpoint directory, for models too big to gather).

    Raises:
        TypeError: a DDP-only argument or a wrong type. ValueError: an unknown option; at setup: a policy class the
            model does not have.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, strategy=AccelFSDP(global_batch_size=1024),
                          plugins=[AccelPrecision("bf16-mixed")])
    """

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool | AccelSyncBatchNorm = True,
        shard_policy: _blocks.ShardPolicy = "auto",
        reshard_after_forward: bool = True,
        reduce_dtype: torch.dtype | None = torch.float32,
        cpu_offload: bool = False,
        activation_checkpointing: bool | _blocks.ShardPolicy = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        hang_timeout: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        ddp_only = sorted(set(kwargs) & set(_DDP_ONLY))
        if ddp_only:
            raise TypeError(
                f"{name}({ddp_only[0]}=...) is a DDP argument; FSDP shards instead of all-reducing. Fix: drop it, or"
                " use AccelDDP."
            )
        if kwargs:
            raise TypeError(f"{name} got unknown argument(s) {sorted(kwargs)}. Fix: see AccelFSDP's arguments.")
        check_backend_spec(name, process_group_backend)
        check_choice(name, "start_method", start_method, ("popen", "spawn", "fork", "forkserver"), "'popen'")
        check_choice(name, "state_dict_type", state_dict_type, ("full", "sharded"), "'full'")
        check_bool(name, "reshard_after_forward", reshard_after_forward)
        # The sharded family's plan (pipeline and tensor sizes 1), checked by name here and sized at setup.
        self._plan = ParallelPlan.build(
            name, None, shard_policy=shard_policy, reshard_after_forward=reshard_after_forward,
            reduce_dtype=reduce_dtype, activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        )  # fmt: skip
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        #: The strategy-independent parts, called from this strategy's hooks below.
        self.parts = AccelParts(
            name, global_batch_size, micro_batch_size, partial_window, sync_batchnorm, hang_timeout, compile
        )
        self._start_method = start_method
        self.state_dict_type = state_dict_type
        self._comm_stats = FSDPCommStats()
        self._sync = GradientSync()  # FSDP's gradient reduction, off for a window's non-final micro-batches
        #: The modules ``fully_shard`` was applied to by this strategy (empty when ``configure_model`` sharded).
        self.sharded_modules: list[torch.nn.Module] = []

    @property
    def plan(self) -> ParallelPlan:
        """The sharding choices (``ParallelPlan``: pipeline and tensor sizes 1), for this world from setup on."""
        return self._plan

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, _START_METHODS, strategy_registry)

    @property
    def shard_policy(self) -> _blocks.ShardPolicy:
        """The blocks ``fully_shard`` is applied to (``plan.shard_policy``)."""
        return self._plan.shard_policy

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 (``True``) or gathered parameters kept to backward (``plan.reshard_after_forward``)."""
        return self._plan.reshard_after_forward

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The gradient reduce-scatter's dtype under mixed precision (``plan.reduce_dtype``)."""
        return self._plan.reduce_dtype

    @property
    def cpu_offload(self) -> bool:
        """Parameters, gradients and optimizer state on the CPU (``plan.cpu_offload``)."""
        return self._plan.cpu_offload

    @property
    def activation_checkpointing(self) -> bool | _blocks.ShardPolicy:
        """What recomputes its activations in backward (``plan.activation_checkpointing``)."""
        return self._plan.activation_checkpointing

    @property
    def comm_stats(self) -> CommStats:
        """All-gather and reduce-scatter counters for the ``EfficiencyMonitor`` (see ``FSDPCommStats``)."""
        return self._comm_stats

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # load_checkpoint restores the optimizers already; True only so that Lightning calls load_optimizer_state_dict
        # (AccelParts' resume fix) right after it restored the loops, the one moment the fix can act.
        return True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint.setdefault("optimizer_states", [])  # loaded above; Lightning only checks the key is there
        return checkpoint

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _compat.strategy_launcher(self, self._start_method)

    @override
    def setup_environment(self) -> None:
        name, world = type(self).__name__, self.num_nodes * self.num_processes
        self._process_group_backend = resolve_backend(
            name, self._process_group_backend, self.root_device, cpu_collectives=self.cpu_offload
        )
        self._plan = self._plan.for_world(name, world, param_dtype=sharding.parameter_dtype(self.precision_plugin))
        # One data-parallel dimension over every rank (Lightning's "auto" would be one rank per node).
        _compat.set_model_parallel_sizes(self, world, 1)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.parts.setup(self, trainer, data_parallel_size=self.world_size)  # before configure_optimizers
        layer_sync = _compat.get_layer_sync(self)
        if trainer.state.fn == TrainerFn.FITTING and layer_sync is not None:
            self.model = layer_sync.apply(self.model)  # before sharding: FSDP keeps the converted layers
        _compat.materialize_distributed_module(self.model, self.root_device)
        # ModelParallelStrategy.setup is Strategy.setup's template plus the demand that configure_model shard the
        # module; this strategy shards a module that did not itself, in _setup_model below, so it runs the template.
        super(ModelParallelStrategy, self).setup(trainer)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise TypeError(f"{type(self).__name__} shards with FSDP2; the model holds FSDP1 wrappers. Fix: drop them.")
        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            self._shard(model)
        install_counting_comms(model, self._comm_stats)
        self._sync.roots = _top_fsdp_modules(model)
        self.barrier()
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        name, plan = type(self).__name__, self._plan
        blocks = _blocks.find_blocks(name, model, plan.shard_policy)
        self.parts.compile_blocks(name, model, blocks)  # per block, before fully_shard (torchtitan's order)
        sharding.checkpoint_blocks(name, model, blocks, plan.activation_checkpointing)
        # 1-D: a 2-D mesh would make fully_shard replicate (HSDP)
        sharding.shard_model(model, self.device_mesh["data_parallel"], blocks, plan)
        self.sharded_modules = [*blocks, model]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches accumulate unsharded gradients locally: no reduce-scatter."""
        # (nested, a micro-batch inside Lightning's window: already off, and the outer one turns it back on)
        with self._sync.switched(False):
            yield

    def gradient_sync(self) -> AbstractContextManager[None]:
        """The backward run inside reduce-scatters, even within Lightning's accumulation window."""
        return self._sync.switched(True)

    def forward_collective(self) -> str | None:
        """What makes a collective in the model's forward: FSDP's all-gathers, always (``"auto"`` measures)."""
        return "FSDP's all-gathers"

    def without_collectives(self) -> AbstractContextManager[Callable[[], None]] | None:
        """A block whose forwards and backwards make no collective, for ``"auto"``'s attempts; None where there is none.

        Every parameter stays gathered and no gradient is reduced inside; the context gives a ``reset`` to call after
        each attempt (on every rank, in step: it gathers again after an attempt a failure left half-run). Needs
        ``FSDPModule.reset_iter_state`` (torch >= 2.14), a model this strategy sharded (whose settings it restores)
        and no other collective in the forward (SyncBatchNorm, a LayerSync plugin).
        """
        other = not self.sharded_modules or self.parts.forward_collective(self) is not None
        return None if other else gathered_attempts(self.sharded_modules, self._sync, self.reshard_after_forward)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self.parts.training_step(self, super().training_step, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        return self.parts.backward(super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if not self._sync.blocked:
            self._comm_stats.rounds += 1  # this backward reduce-scattered every group

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self.parts.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # loaded in load_checkpoint already
        self.parts.loops_restored()

    @override
    def teardown(self) -> None:
        self.parts.teardown()
        layer_sync = _compat.get_layer_sync(self)
        if layer_sync is not None and self.model is not None:
            self.model = layer_sync.revert(self.model)
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.parts.explain_failure(self, exception)


def _top_fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """The outermost FSDP modules of ``model``, whose gradient sync the accumulation switches."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return [model]
    found: list[Any] = []
    for module in model.modules():
        inside = any(module in set(top.modules()) for top in found)
        if isinstance(module, FSDPModule) and not inside:
            found.append(module)
    return found
