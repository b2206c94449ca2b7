"""AccelDDP: Lightning's DDPStrategy with portable SyncBatchNorm, counted comm hooks and the global-batch rule."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.strategies.ddp._bucket_rounds import BucketRounds
from lit_accel.strategies.ddp._comm_hooks import (
    CommHook,
    CommHookName,
    counting_comm_hook,
    resolve_comm_hook,
    validate_comm,
)
from lit_accel.strategies.parts._backend import backend_for_device, check_backend_spec
from lit_accel.strategies.parts._comm_stats import HookCommStats
from lit_accel.strategies.parts.accel_parts import AccelParts, register_names, serves_parts_attributes
from lit_accel.utilities._compat import set_ddp_sample_rate
from lit_accel.utilities._validation import check_bool, check_choice, check_number
from lit_accel.utilities._workarounds import check_static_graph_accumulation

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

    from lit_accel.protocols import CommStats

__all__ = ["AccelDDP"]

# DistributedDataParallel arguments AccelDDP sets itself; any other of its arguments may come through **kwargs.
_DDP_OWN_ARGS = ("self", "module", "device_ids", "output_device")
_START_METHODS = {
    "accel_ddp": "popen",
    "accel_ddp_spawn": "spawn",
    "accel_ddp_fork": "fork",
    "accel_ddp_notebook": "fork",
}
#: DDPStrategy's argument names -> AccelDDP's: the same things, accepted under either name.
_ALIASES = {"ddp_comm_state": "comm_state", "ddp_comm_hook": "comm_hook", "ddp_comm_wrapper": "comm_wrapper"}


@serves_parts_attributes
class AccelDDP(DDPStrategy):
    """DDP with SyncBatchNorm on every backend, comm hooks on every backend (counted), and the global-batch rule.

    A drop-in for ``DDPStrategy``: the same positional and keyword arguments (``ddp_comm_hook``/``ddp_comm_state``/
    ``ddp_comm_wrapper`` are aliases of ``comm_hook``/``comm_state``/``comm_wrapper``; post-local SGD works with
    ``model_averaging_period``), extra keyword arguments go to ``DistributedDataParallel``. On top: with
    ``global_batch_size`` the accumulation is planned at setup, before ``configure_optimizers``, as
    ``global / (loaded batch x world size)`` (:attr:`batch_plan`); non-final batches of a window skip the all-reduce,
    and an epoch's last, partial window is averaged over the batches it had (Lightning #19987). ``comm_stats`` counts
    every all-reduce for the ``EfficiencyMonitor`` without a host sync. Behaviour in detail: ``docs/strategies.md``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the Trainer.
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: ``DDPStrategy``'s names of the three ``comm_*`` arguments.
        model_averaging_period: with ``comm_state=PostLocalSGDState(...)``: average the models every this many steps.
        process_group_backend: any spelling torch accepts (``"NCCL"``, ``"cpu:gloo,cuda:nccl"``, registered ones);
            ``None`` picks nccl on CUDA, gloo on CPU.
        timeout: collective timeout. start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        global_batch_size: samples per optimizer step over all devices (sets ``accumulate_grad_batches``).
        micro_batch_size: an int that splits each loaded batch into chunks of that size (it never changes the
            accumulation), or ``"auto"``: the largest that fits in memory, found before the first step.
        partial_window: ``"mean"`` (exact) or ``"lightning"`` (Lightning's division by the full count).
        sync_batchnorm: ``True``, ``False`` or an :class:`~lit_accel.AccelSyncBatchNorm` (e.g. ``group_size=8``).
        hang_timeout: seconds without progress before the :class:`~lit_accel.HangWatchdog` it adds ends the job;
            ``None``: the watchdog only reports a stall (after 300 s, once per stall) and never ends the job.
        compile: ``True`` or ``torch.compile``'s arguments: each block compiled before DDP wraps the model.
        comm_hook: ``"fp16"``, ``"bf16"``, ``"powersgd"``, a callable ``hook(state, bucket)``, or ``None`` (DDP's
            all-reduce; torch's hook once asked for exact timing). A hook is wrapped to count and time buckets.
        comm_state: the hook's state (a ``PowerSGDState``, ``PostLocalSGDState``, ...; default: DDP's group).
        comm_wrapper: a hook wrapper such as ``default_hooks.fp16_compress_wrapper``.
        gradient_as_bucket_view: let gradients alias DDP's buckets (one gradient-sized copy less; torch's default: no).
        **kwargs: other ``DistributedDataParallel`` arguments (``static_graph``, ``bucket_cap_mb``, ...).

    Raises:
        TypeError: an argument of the wrong type or an unknown DDP argument. ValueError: an invalid value, or
            contradicting settings; at setup or fit start (before the first step): see ``docs/reliability.md``.

    Example::

        trainer = Trainer(accelerator="gpu", devices=4, strategy=AccelDDP(global_batch_size=1024, comm_hook="bf16"))
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool | AccelSyncBatchNorm = True,
        comm_hook: CommHookName | CommHook | None = None,
        comm_state: object | None = None,
        comm_wrapper: Callable | None = None,
        gradient_as_bucket_view: bool = True,
        hang_timeout: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        hook, state, wrapper = _merge_aliases(
            name, dict(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper),
            dict(comm_state=comm_state, comm_hook=comm_hook, comm_wrapper=comm_wrapper),
        )  # fmt: skip
        validate_comm(name, hook, state, wrapper, model_averaging_period)
        check_choice(name, "start_method", start_method, ("popen", "spawn", "fork", "forkserver"), "'popen'")
        check_backend_spec(name, process_group_backend)
        check_bool(name, "gradient_as_bucket_view", gradient_as_bucket_view)
        kwargs = _ddp_kwargs(name, kwargs)
        kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            # Only post-local SGD's state reaches DDPStrategy, whose model averaging this strategy reuses; hooks are
            # registered by configure_ddp below, on every backend.
            ddp_comm_state=state if model_averaging_period is not None else None,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        #: The strategy-independent parts, called from this strategy's hooks below.
        self.parts = AccelParts(
            name, global_batch_size, micro_batch_size, partial_window, sync_batchnorm, hang_timeout, compile
        )
        self._comm_hook, self._comm_state, self._comm_wrapper = hook, state, wrapper
        self._comm_stats = HookCommStats()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, _START_METHODS, strategy_registry)

    @property
    def comm_stats(self) -> CommStats:
        """All-reduce counters for the ``EfficiencyMonitor``: every bucket counted, timed by DDP's samples or a hook."""
        return self._comm_stats

    @override
    def setup_environment(self) -> None:
        if self._process_group_backend is not None:
            backend_for_device(type(self).__name__, self._process_group_backend, self.root_device)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.parts.setup(self, trainer, data_parallel_size=self.world_size)  # before configure_optimizers
        static_graph = bool(self._ddp_kwargs.get("static_graph"))
        check_static_graph_accumulation(type(self).__name__, static_graph, trainer.accumulate_grad_batches)
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        self.parts.compile_blocks(type(self).__name__, self.model)  # before DDP wraps it: hooks outside the graphs
        super().configure_ddp()  # wraps the model; registers no hook, since DDPStrategy's ddp_comm_hook is None
        assert isinstance(self.model, DistributedDataParallel)
        stats = self._comm_stats
        stats.release_rounds()  # a model of an earlier fit
        if self._comm_hook is None and self._comm_wrapper is None:
            # DDP's C++ all-reduce, counted from the strategy's backward; on_train_start may add the timing hook.
            stats.bucket_rounds = BucketRounds(self.model, stats.rounds)
            # DDP times a round in C++ every this many rounds: a fresh sample for each logging window's estimate (on
            # CUDA, one host sync per sample instead of per 100 rounds; docs/strategies.md). Not logging: torch's rate.
            trainer = self.parts.trainer
            if trainer is not None and trainer.log_every_n_steps > 0:
                set_ddp_sample_rate(self.model, trainer.log_every_n_steps)
        else:
            self._register_counting_hook()

    def _register_counting_hook(self) -> None:
        """The comm hook (torch's all-reduce for ``comm_hook=None``), wrapped to count and time every bucket."""
        assert isinstance(self.model, DistributedDataParallel)
        self._comm_stats.release_rounds()
        hook, state, kind = resolve_comm_hook(
            self._comm_hook, self._comm_state, self._comm_wrapper, self.model.process_group
        )
        # Registered on every backend: DDPStrategy only does it on CUDA (see _workarounds, "comm_hooks_on_cpu").
        self.model.register_comm_hook(state, counting_comm_hook(hook, kind, self._comm_stats))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # After the callbacks' on_train_start, before the first training backward: a consumer that asked for exact
        # timing (EfficiencyMonitor(exact_comm_timing=True)) gets the timing hook; otherwise no Python runs per bucket.
        if self._comm_stats.bucket_rounds is not None and self._comm_stats.timing_requested:
            self._register_counting_hook()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self.parts.training_step(self, super().training_step, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        output = self.parts.backward(super().backward, closure_loss, optimizer, *args, **kwargs)
        # Without a hook, a round is a backward the reducer was prepared for (by DDP's forward, or Lightning's
        # prepare_for_backward in manual optimization): the one flag DDP sets exactly then.
        if self._comm_stats.bucket_rounds is not None and getattr(self.model, "require_forward_param_sync", False):
            self._comm_stats.count_round()
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self.parts.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.parts.loops_restored()

    def forward_collective(self) -> str | None:
        """What makes a collective in the model's forward (SyncBatchNorm, DDP's buffer broadcast), or None."""
        module = self.lightning_module
        broadcasts = self._ddp_kwargs.get("broadcast_buffers") is not False and any(True for _ in module.buffers())
        return self.parts.forward_collective(self) or ("DDP's buffer broadcast" if broadcasts else None)

    @contextmanager
    def gradient_sync(self) -> Generator[None, None, None]:
        """The backward run inside all-reduces, even within Lightning's accumulation window (DDP's no_sync undone)."""
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        # the inverse of DDP's no_sync(): its next forward prepares the reducer, and the backward all-reduces
        previous, model.require_backward_grad_sync = model.require_backward_grad_sync, True
        try:
            yield
        finally:
            model.require_backward_grad_sync = previous

    @override
    def teardown(self) -> None:
        self.parts.teardown()
        self._comm_stats.release_rounds()  # counted; the model is not kept
        self._comm_stats.timing_requested = False  # a consumer of the next fit asks again
        trainer = self.parts.trainer
        accumulating = trainer is not None and trainer.accumulate_grad_batches > 1
        if accumulating and isinstance(self.model, DistributedDataParallel):
            # Unwrap here so DDPStrategy.teardown skips its "pass static_graph=True" hint, refused with accumulation.
            self.model = self.lightning_module
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.parts.explain_failure(self, exception)


def _merge_aliases(owner: str, lightning: dict[str, Any], ours: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(hook, state, wrapper)`` from either spelling; both given with different values is an error."""
    merged = {}
    for lightning_name, our_name in _ALIASES.items():
        a, b = lightning[lightning_name], ours[our_name]
        if a is not None and b is not None and a is not b:
            raise ValueError(
                f"{owner}({lightning_name}=..., {our_name}=...): two values for the same argument. Fix: pass one."
            )
        merged[our_name] = a if a is not None else b
    return merged["comm_hook"], merged["comm_state"], merged["comm_wrapper"]


def _ddp_kwargs(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments to pass on to ``DistributedDataParallel``: the ones that differ from its defaults.

    A misspelled name fails now, before any process starts. Defaults are accepted and dropped, whoever passed them
    (LightningCLI passes every parameter it finds, with its default); DDP judges the values, except a few whose wrong
    type DDP would accept silently.
    """
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    allowed = [p for p in parameters if p not in _DDP_OWN_ARGS]
    unknown = sorted(k for k in kwargs if k not in parameters)
    if unknown:
        raise TypeError(
            f"{owner} got unknown argument(s) {unknown}; extra keyword arguments go to DistributedDataParallel. Fix:"
            f" use one of {', '.join(allowed)}."
        )
    given = {k: v for k, v in kwargs.items() if not _is_default(v, parameters[k].default)}
    own = sorted(k for k in given if k in _DDP_OWN_ARGS)
    if own:
        raise TypeError(f"{owner}({own[0]}=...) is set by the strategy from the Trainer's devices. Fix: drop it.")
    for flag in ("static_graph", "find_unused_parameters", "broadcast_buffers"):
        if flag in given:
            check_bool(owner, flag, given[flag])
    if given.get("bucket_cap_mb") is not None:
        fix = "pass MiB, e.g. bucket_cap_mb=25 (torch's default)"
        check_number(owner, "bucket_cap_mb", given["bucket_cap_mb"], allow_none=True, fix=fix)
    return given


def _is_default(value: Any, default: Any) -> bool:
    plain = (bool, int, float, str)
    return value is default or (isinstance(value, plain) and type(value) is type(default) and value == default)
