"""AccelFSDP: sharded data parallel (FSDP2 over the world), AccelParallel's preset without pipeline or tensor."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from lit_accel.layout import blocks as _blocks
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.strategies.parts.accel_parts import register_names
from lit_accel.strategies.sharded.accel_parallel import AccelParallel

__all__ = ["AccelFSDP"]

_START_METHODS = {
    "accel_fsdp": "popen",
    "accel_fsdp_spawn": "spawn",
    "accel_fsdp_fork": "fork",
    "accel_fsdp_notebook": "fork",
}
_DDP_ONLY = ("static_graph", "find_unused_parameters", "gradient_as_bucket_view", "bucket_cap_mb", "comm_hook",
             "ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")  # fmt: skip


class AccelFSDP(AccelParallel):
    """Fully sharded data parallel (FSDP2, ZeRO-3) with the global batch, exact windows, SyncBN and counted comms.

    ``AccelParallel`` with pipeline and tensor sizes 1 (one code path), with FSDP's defaults: a ``"full"``
    checkpoint and ZeRO-3. Parameters, gradients and optimizer state are sharded over all ranks (``fully_shard`` on
    each block of the model, then the root), so each rank holds 1/N of them. With ``AccelPrecision("bf16-mixed"|
    "16-mixed")`` the blocks compute in bf16/fp16 through FSDP2's ``MixedPrecisionPolicy`` (fp32 master shards,
    gradients reduced in ``reduce_dtype``); fp16 loss scaling skips a step on every rank when any rank's shard
    overflows. Non-final micro-batches skip the reduce-scatter. A model whose ``configure_model`` shards itself (as
    for Lightning's ``ModelParallelStrategy``, with ``self.device_mesh``) is left as it is. ``docs/strategies.md``.

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
        data_replicate: ``> 1``: HSDP (replicated over that many groups, sharded within each).

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
        data_replicate: int = 1,
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
        super().__init__(
            data_replicate=data_replicate, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
            partial_window=partial_window, sync_batchnorm=sync_batchnorm, shard_policy=shard_policy,
            reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype,
            activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
            state_dict_type=state_dict_type, hang_timeout=hang_timeout, compile=compile,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )  # fmt: skip

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, _START_METHODS, strategy_registry)

    @property
    def shard_policy(self) -> _blocks.ShardPolicy:
        """The blocks ``fully_shard`` is applied to (``plan.shard_policy``)."""
        return self.plan.shard_policy

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 (``True``) or gathered parameters kept to backward (``plan.reshard_after_forward``)."""
        return bool(self.plan.reshard_after_forward)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The gradient reduce-scatter's dtype under mixed precision (``plan.reduce_dtype``)."""
        return self.plan.reduce_dtype

    @property
    def cpu_offload(self) -> bool:
        """Parameters, gradients and optimizer state on the CPU (``plan.cpu_offload``)."""
        return self.plan.cpu_offload

    @property
    def activation_checkpointing(self) -> bool | _blocks.ShardPolicy:
        """What recomputes its activations in backward (``plan.activation_checkpointing``)."""
        return self.plan.activation_checkpointing
