"""AccelDDP: DistributedDataParallel with portable SyncBatchNorm, counted comm hooks and a global-batch rule."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm, count_batchnorm_layers
from lit_accel.strategies._comm_hooks import (
    CommHook,
    CommHookName,
    CommStats,
    DDPLoggingCommStats,
    SupportsCommStats,
    counting_comm_hook,
    resolve_comm_hook,
    validate_comm_hook,
)
from lit_accel.strategies._global_batch import GlobalBatch
from lit_accel.strategies._peer_failure import explain_peer_failure, is_peer_loss
from lit_accel.utilities._compat import (
    DDP_DEFAULT_LOGGING_SAMPLE_RATE,
    get_layer_sync,
    launched_child_processes,
    resume_restored_finished_epoch,
    set_ddp_logging_sample_rate,
    set_layer_sync,
)
from lit_accel.utilities._validation import check_bool, check_choice, check_int, check_number

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["AccelDDP"]

# Arguments DistributedDataParallel takes besides the module and the ones AccelDDP sets itself.
_DDP_OWN_ARGS = ("self", "module", "device_ids", "output_device")
_LIGHTNING_COMM_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_START_METHODS = {
    "accel_ddp": "popen",
    "accel_ddp_spawn": "spawn",
    "accel_ddp_fork": "fork",
    "accel_ddp_notebook": "fork",
}


class AccelDDP(DDPStrategy):
    """DDP with portable SyncBatchNorm, comm hooks on every backend, and the global-batch rule.

    Three things plain ``DDPStrategy`` does not do:

    * **SyncBatchNorm everywhere.** While fitting, every ``torch.nn.modules.batchnorm._BatchNorm`` computes its
      statistics over all ranks (or over consecutive groups of ``sync_bn_group_size`` ranks, e.g. one node, as Apex
      did). The CPU/gloo path uses lit_accel's portable implementation (torch's ``SyncBatchNorm`` is CUDA-only). At
      teardown the model holds its original classes again with the synced running statistics, so checkpoints load
      into the plain model.
    * **All-reduce accounting for the ``EfficiencyMonitor``** (:attr:`comm_stats`: collectives, bytes, time) at no
      per-step cost. By default no comm hook is registered: DDP's built-in C++ all-reduce runs exactly as under
      ``DDPStrategy``, and the numbers come from host-counted all-reduce rounds and DDP's own logging (bucket layout,
      sampled communication time). **Comm hooks run on every backend**, gloo included (Lightning registers them only
      on CUDA): a hook given with ``comm_hook`` is wrapped so that every bucket it reduces is counted and timed.
    * **The global-batch rule** (Goyal et al., 2017): with ``global_batch_size``, the accumulation is set at fit
      start to ``global / (micro-batch per device x devices x nodes)``, so the same training dynamics hold on 1 or
      8 GPUs. Non-final micro-batches of a window run under DDP's ``no_sync`` (one all-reduce round per optimizer
      step), and the last, partial window of an epoch is averaged over the micro-batches it really had (Lightning
      divides it by the full count: issue #19987).

    BatchNorm caveat: statistics are computed per micro-batch (per forward), never over the accumulated global
    batch. Accumulating 8 micro-batches of 32 is not the same as one batch of 256 for a BatchNorm model; SyncBN
    widens each forward across devices only. Keep the micro-batch large enough for stable statistics.

    Reliability (``docs/reliability.md``): with ``max_steps`` set, resuming from a checkpoint taken after an epoch's
    last batch continues exactly (Lightning 2.6 alone trains one spurious batch first); and when a rank raises or is
    killed, the other ranks' transport error ("Connection closed by peer") is extended to say which rank ended and how.

    Args:
        global_batch_size: samples per optimizer step over all devices; sets ``trainer.accumulate_grad_batches``.
            ``None`` keeps ``Trainer(accumulate_grad_batches=...)``.
        micro_batch_size: per-device batch size, for loaders whose batch size cannot be read (custom batch
            samplers). Given with ``global_batch_size``, the accumulation is known already at setup, so
            ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` sees it.
        partial_window: ``"mean"`` averages the last, partial window of an epoch over the micro-batches it had (its
            update equals a big batch of those micro-batches). ``"lightning"`` keeps Lightning's division by the full
            count, which weights every sample of the epoch equally (the short window's update is scaled down in
            proportion to its size) - choose it to reproduce runs made with plain Lightning.
        sync_batchnorm: synchronise BatchNorm statistics across ranks while fitting.
        sync_bn_group_size: synchronise within consecutive groups of this many ranks; must divide the world size.
            ``None`` means all ranks.
        sync_bn_implementation: ``"portable"`` (all-reduce of one fused statistics tensor; any backend),
            ``"torch"`` (``torch.nn.SyncBatchNorm``; CUDA only) or ``"auto"`` (torch's on CUDA, portable elsewhere).
        comm_hook: ``"fp16"`` / ``"bf16"`` (compress gradients to 16 bits for the all-reduce), ``"powersgd"``
            (low-rank compression, Vogels et al., 2019), a callable ``hook(state, bucket) -> Future[Tensor]``, or
            ``None`` for the plain all-reduce mean: DDP's built-in path with no Python hook (the fastest; its
            all-reduce time is DDP's sampled per-round figure). To time every all-reduce of the plain mean instead,
            pass ``comm_hook=torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``.
        comm_state: state for a callable hook (default: DDP's process group, the state torch's own hooks take), or a
            ready ``PowerSGDState`` for ``"powersgd"``.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (default 1).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter`` (default 1000; at least 2): steps of plain
            all-reduce before compressing.
        gradient_as_bucket_view: let gradients alias DDP's buckets (saves one gradient-sized copy and memory).
        bucket_cap_mb: DDP bucket size in MiB; ``None`` keeps torch's default (25).
        static_graph: DDP's static-graph optimisation. Refused with gradient accumulation (see ``Raises``).
        find_unused_parameters: let DDP detect parameters without gradients (costs a graph traversal per step).
        process_group_backend: ``None`` picks from the accelerator (nccl on CUDA, gloo on CPU).
        timeout: collective timeout.
        start_method: how processes are launched (``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``).
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        **ddp_kwargs: other ``DistributedDataParallel`` arguments (e.g. ``forward_sync_buffers``).

    Raises:
        TypeError: a flag is not a bool, a hook is not callable with ``(state, bucket)``, an unknown DDP argument,
            or one of ``DDPStrategy``'s ``ddp_comm_*`` arguments (use ``comm_hook``/``comm_state``).
        ValueError: a size is not a positive int, an unknown option, ``powersgd_*`` without ``"powersgd"``, a
            PostLocalSGD state; at setup: ``sync_bn_group_size`` not dividing the world size, nccl on a CPU device,
            ``static_graph=True`` with accumulation > 1, ``Trainer(sync_batchnorm=True)`` with
            ``sync_batchnorm=False``, ``global_batch_size`` with a ``GradientAccumulationScheduler``; at fit start
            (before the first step; at setup when ``micro_batch_size`` is given): a global batch that does not
            divide, a conflicting ``Trainer(accumulate_grad_batches=...)``, an unreadable or per-rank different
            micro-batch size, ``static_graph=True`` with the resulting accumulation > 1.

    Example::

        from lightning.pytorch import Trainer
        from lit_accel import AccelDDP

        # 1024 = 32 per device x 8 accumulation x 4 devices, and the same dynamics on 8 devices (accumulation 4)
        trainer = Trainer(accelerator="gpu", devices=4, strategy=AccelDDP(global_batch_size=1024, comm_hook="bf16"))
        trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=32))
    """

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool = True,
        sync_bn_group_size: int | None = None,
        sync_bn_implementation: Literal["auto", "portable", "torch"] = "auto",
        comm_hook: CommHookName | CommHook | None = None,
        comm_state: object | None = None,
        powersgd_rank: int | None = None,
        powersgd_start_iter: int | None = None,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        check_int("AccelDDP", "global_batch_size", global_batch_size, allow_none=True, example=1024)
        check_int("AccelDDP", "micro_batch_size", micro_batch_size, allow_none=True, example=32)
        if micro_batch_size is not None and global_batch_size is None:
            raise ValueError(
                f"AccelDDP(micro_batch_size={micro_batch_size}) only serves global_batch_size, which is None. Fix:"
                " pass global_batch_size=..., or drop micro_batch_size (the dataloader's batch size is used)."
            )
        check_choice("AccelDDP", "partial_window", partial_window, ("mean", "lightning"), "'mean' (the default)")
        for name, flag in (
            ("sync_batchnorm", sync_batchnorm),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
            ("find_unused_parameters", find_unused_parameters),
        ):
            check_bool("AccelDDP", name, flag)
        check_int("AccelDDP", "sync_bn_group_size", sync_bn_group_size, allow_none=True, example=8)
        check_choice(
            "AccelDDP", "sync_bn_implementation", sync_bn_implementation, ("auto", "portable", "torch"), "'auto'"
        )
        check_choice("AccelDDP", "start_method", start_method, ("popen", "spawn", "fork", "forkserver"), "'popen'")
        validate_comm_hook(comm_hook, comm_state, powersgd_rank, powersgd_start_iter)
        check_number(
            "AccelDDP",
            "bucket_cap_mb",
            bucket_cap_mb,
            allow_none=True,
            fix="pass MiB, e.g. bucket_cap_mb=25 (torch's default)",
        )
        if process_group_backend is not None and process_group_backend not in dist.Backend.backend_list:
            raise ValueError(
                f"AccelDDP(process_group_backend={process_group_backend!r}): expected None (nccl on CUDA, gloo on"
                f" CPU) or one of {', '.join(b for b in dist.Backend.backend_list if b != 'undefined')}."
            )
        self._check_ddp_kwargs(ddp_kwargs)
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            **ddp_kwargs,
        )
        self._accumulation = GlobalBatch(global_batch_size, micro_batch_size, partial_window, static_graph)
        self._sync_batchnorm = sync_batchnorm
        self._sync_bn_group_size = sync_bn_group_size
        self._sync_bn_implementation = sync_bn_implementation
        self._comm_hook = comm_hook
        self._comm_state = comm_state
        self._powersgd_rank = 1 if powersgd_rank is None else powersgd_rank
        self._powersgd_start_iter = 1000 if powersgd_start_iter is None else powersgd_start_iter
        #: All-reduce counters for the ``EfficiencyMonitor`` (``calls``, ``bytes``, ``pop_elapsed_s()``): counted by
        #: the hook wrapper with ``comm_hook``, else derived from all-reduce rounds and DDP's own logging.
        self.comm_stats: SupportsCommStats = CommStats() if comm_hook is not None else DDPLoggingCommStats()
        self._round_counter = self.comm_stats if isinstance(self.comm_stats, DDPLoggingCommStats) else None
        self._reducer_prepared = False  # the last DDP forward prepared the reducer for an all-reduce round
        self._told_no_batchnorm = False
        self._attached_trainer: pl.Trainer | None = None  # set in setup(); the strategy's hooks do not receive it

    @staticmethod
    def _check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
        for key in ddp_kwargs:
            if key in _LIGHTNING_COMM_ARGS:
                raise TypeError(
                    f"AccelDDP({key}=...) is DDPStrategy's argument; AccelDDP registers hooks on every backend with"
                    " comm_hook= (a name or a callable) and comm_state=. Fix: pass those instead."
                )
        allowed = [p for p in inspect.signature(DistributedDataParallel.__init__).parameters if p not in _DDP_OWN_ARGS]
        unknown = sorted(set(ddp_kwargs) - set(allowed))
        if unknown:
            raise TypeError(
                f"AccelDDP got unknown argument(s) {unknown}: extra keyword arguments go to DistributedDataParallel,"
                f" which accepts {', '.join(allowed)}."
            )

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all devices: the configured value, else micro x accumulation x world."""
        if self._accumulation.global_batch_size is not None:
            return self._accumulation.global_batch_size
        trainer, micro = self._attached_trainer, self._accumulation.resolved_micro_batch_size
        if micro is None or trainer is None:
            return None
        return micro * trainer.accumulate_grad_batches * self.world_size

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward on one device, known from fit start (or construction, if given)."""
        return self._accumulation.resolved_micro_batch_size

    @property
    def sync_bn_group_size(self) -> int | None:
        """Ranks per SyncBatchNorm group (``None``: all ranks)."""
        return self._sync_bn_group_size

    @override
    def setup_environment(self) -> None:
        backend = self.process_group_backend
        if backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"AccelDDP(process_group_backend='nccl') needs CUDA devices, but this process runs on"
                f" {self.root_device}. Fix: drop process_group_backend (gloo is chosen on CPU) or use"
                " accelerator='gpu'."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._attached_trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._accumulation.at_setup(trainer, self.lightning_module, self.world_size)
            self._setup_layer_sync()
        super().setup(trainer)

    def _setup_layer_sync(self) -> None:
        module = self.lightning_module
        no_batchnorm = module is not None and count_batchnorm_layers(module) == 0
        if self._sync_batchnorm and no_batchnorm and not self._told_no_batchnorm:
            self._told_no_batchnorm = True
            rank_zero_info(
                "AccelDDP(sync_batchnorm=True): the model has no BatchNorm layer, so there is nothing to"
                " synchronise. Pass sync_batchnorm=False to silence this."
            )
        current = get_layer_sync(self)  # what the Trainer put there: from Trainer(sync_batchnorm=) or plugins=
        if current is not None and not isinstance(current, TorchSyncBatchNorm):
            # The user passed a LayerSync plugin explicitly (ours, configured their way, or their own): respect it.
            return
        if not self._sync_batchnorm:
            if current is not None:
                raise ValueError(
                    "AccelDDP(sync_batchnorm=False) contradicts Trainer(sync_batchnorm=True). Fix: drop one of them."
                )
            return
        world_size = self.world_size
        group_size = self._sync_bn_group_size
        if group_size is not None and world_size % group_size:
            allowed = [k for k in range(1, world_size + 1) if world_size % k == 0]
            raise ValueError(
                f"AccelDDP(sync_bn_group_size={group_size}) must divide the world size {world_size} (devices x"
                f" nodes). Allowed: {allowed} or None (all ranks). Fix: pass e.g. the devices per node."
            )
        if current is not None:
            rank_zero_info(
                "AccelDDP: Trainer(sync_batchnorm=True) is replaced by AccelDDP's SyncBatchNorm, which also works on"
                " CPU/gloo and restores the original BatchNorm classes at teardown."
            )
        if world_size == 1 or group_size == 1:
            # A group of one rank has nothing to synchronise with: plain BatchNorm is exactly right, and cheaper.
            set_layer_sync(self, None)
            return
        set_layer_sync(self, AccelSyncBatchNorm(group_size=group_size, implementation=self._sync_bn_implementation))

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model; registers no hook, since DDPStrategy's ddp_comm_hook is None
        assert isinstance(self.model, DistributedDataParallel)
        if self._round_counter is not None:
            # No hook: DDP's C++ all-reduce (a Python hook costs ~1 ms per step on a CPU ViT, benchmarks/RESULTS.md).
            self._round_counter.attach(self.model)
            set_ddp_logging_sample_rate(self.model, self._ddp_logging_sample_rate())
            return
        hook, state, kind = resolve_comm_hook(
            self._comm_hook, self._comm_state, self._powersgd_rank, self._powersgd_start_iter, self.model.process_group
        )
        assert isinstance(self.comm_stats, CommStats)
        # Registered on every backend: DDPStrategy only does it on CUDA, but gloo runs every hook.
        self.model.register_comm_hook(state, counting_comm_hook(hook, kind, self.comm_stats))

    def _ddp_logging_sample_rate(self) -> int:
        """How often DDP samples its runtime stats (the all-reduce time of the hookless ``comm_stats``).

        DDP samples synchronised iterations 1-10 and then every ``rate``-th. On CPU a sample costs a few clock
        reads (sampling every iteration measured no difference in CPU time per iteration against every 100th, within
        +-50 us of 3.2 ms, 152 parameter tensors, torch 2.14): every iteration, so the time is from the window being
        logged. On CUDA the next synchronised forward after a sample waits for its events; every
        ``log_every_n_steps`` iterations puts that wait right after a logging step, where the ``EfficiencyMonitor``
        (and Lightning's logging of tensors) already synchronised, so it finds the events complete.
        """
        if self.root_device.type == "cpu":
            return 1
        trainer = self._attached_trainer
        every = trainer.log_every_n_steps if trainer is not None else 0
        return every if every > 0 else DDP_DEFAULT_LOGGING_SAMPLE_RATE

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        counter = self._round_counter
        if counter is None:
            return
        # A backward reduces every bucket once (one round) when the reducer was prepared for it: by the forward in
        # automatic optimization, by DDPStrategy.pre_backward before every manual_backward outside no_sync() in
        # manual optimization (so two such manual_backward calls on one forward are two rounds).
        if not self._reducer_prepared:
            model, module = self.model, self.lightning_module
            manual = module is not None and not module.automatic_optimization
            self._reducer_prepared = (
                manual and isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync
            )
        if self._reducer_prepared:
            counter.add_round()
            self._reducer_prepared = False

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # Lightning restores the loops right before the optimizers (CheckpointConnector.restore_training_state), and
        # this is the first strategy hook after that. With max_steps set, a checkpoint taken after an epoch's last
        # batch would otherwise resume with one spurious batch (index num_batches, data of batch 0); see the helper.
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            resume_restored_finished_epoch(trainer)

    @override
    def on_train_start(self) -> None:
        trainer = self._attached_trainer
        assert trainer is not None
        self._accumulation.at_train_start(
            trainer, self.lightning_module, self.world_size, self.root_device, bool(self.lr_scheduler_configs)
        )
        super().on_train_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # Micro-batches since the last optimizer step: Lightning starts a window at batch_idx % k == 0 and forces
        # a step on the last batch of the epoch, so only that window can be shorter than k.
        self._accumulation.window_micro_batches += 1
        if self._round_counter is not None:
            model, module = self.model, self.lightning_module
            # In automatic optimization DDP's forward prepares its reducer for one all-reduce round when grad is
            # enabled outside no_sync() (DistributedDataParallel._post_forward); Lightning runs the non-final
            # micro-batches of a window under no_sync(). In manual optimization Lightning keeps the forward from
            # preparing it (_DDPForwardRedirection clears require_backward_grad_sync around the inner forward).
            self._reducer_prepared = (
                isinstance(model, DistributedDataParallel)
                and module is not None
                and module.automatic_optimization
                and model.require_backward_grad_sync
                and torch.is_grad_enabled()
            )
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        trainer, module = self._attached_trainer, self.lightning_module
        accumulation = 1 if trainer is None else trainer.accumulate_grad_batches
        automatic = module is None or module.automatic_optimization
        closure = self._accumulation.wrap_closure(closure, optimizer, accumulation, automatic)
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._accumulation.window_micro_batches = 0

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # A rank that raised or was killed surfaces on the others as a transport error naming an address; say which
        # rank ended and how (rank 0 of a popen launch knows its children's exit codes and signals).
        if self.world_size > 1 and is_peer_loss(exception):
            first_rank = self.node_rank * self.num_processes
            children = [(first_rank + local, proc) for local, proc in launched_child_processes(self)]
            explain_peer_failure(exception, self.world_size, children)

    @override
    def teardown(self) -> None:
        trainer = self._attached_trainer
        accumulating = trainer is not None and trainer.accumulate_grad_batches > 1
        if accumulating and isinstance(self.model, DistributedDataParallel):
            # Unwrap here so DDPStrategy.teardown skips its "pass static_graph=True" hint: with accumulation that
            # advice leads to the refusal above.
            self.model = self.lightning_module
        if self._round_counter is not None:
            self._round_counter.detach()  # keeps the totals, drops the DDP model (and its buckets)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``accel_ddp``, ``accel_ddp_spawn``, ``accel_ddp_fork`` and ``accel_ddp_notebook`` (idempotent)."""
        for name, start_method in _START_METHODS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(
                name,
                cls,
                description=f"AccelDDP (SyncBatchNorm, counted comm hooks, global batch) with start_method"
                f" '{start_method}'",
                start_method=start_method,
            )
