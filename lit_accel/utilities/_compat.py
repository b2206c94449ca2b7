"""The one place where lit_accel touches private attributes of Lightning and torch.

Every accessor here is exercised by ``tests/utilities/test_compat_*.py``, so a Lightning or torch release that moves
one of them fails loudly in CI instead of silently changing behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

if TYPE_CHECKING:
    from lightning.pytorch.plugins import LayerSync


def grad_scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scale tensor of a ``GradScaler`` without a host sync (``_scale``; ``get_scale()`` syncs).

    ``None`` until the first ``scaler.scale(...)`` creates it, and for a disabled scaler (which has no such attribute).
    """
    return scaler._scale if scaler.is_enabled() else None


@contextmanager
def grad_scaler_scale_swapped(scaler: torch.amp.GradScaler, scale: torch.Tensor) -> Iterator[None]:
    """Let ``GradScaler``'s own ``unscale_``/``step`` divide by (or hand fused kernels) ``scale`` (``_scale``)."""
    previous = scaler._scale
    scaler._scale = scale
    try:
        yield
    finally:
        scaler._scale = previous


def grad_scaler_grads_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` already ran in this iteration (``GradScaler._per_optimizer_states``).

    False for fused optimizers, whose kernel ``GradScaler.step`` hands the scale. ``.get``: no entry in the defaultdict.
    """
    if not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is OptState.UNSCALED


def get_layer_sync(strategy: object) -> LayerSync | None:
    """The ``LayerSync`` plugin of a parallel strategy (``ParallelStrategy._layer_sync``).

    The Trainer's accelerator connector assigns it after the strategy's ``__init__`` (from
    ``Trainer(sync_batchnorm=)`` or ``plugins=``), and ``DDPStrategy.setup``/``teardown`` apply and revert it.
    """
    return strategy._layer_sync  # type: ignore[attr-defined]


def set_layer_sync(strategy: object, layer_sync: LayerSync | None) -> None:
    """Replace the strategy's ``LayerSync`` plugin; call it in ``setup()`` before ``DDPStrategy.setup`` applies it."""
    strategy._layer_sync = layer_sync  # type: ignore[attr-defined]


# --- AccelPrecision / DynamicGradScaler (tests: tests/utilities/test_compat_precision.py) ---

#: The ``GradScaler`` method ``step()`` calls for non-fused optimizers: it reads the found-inf flags with ``.item()``
#: (torch's one host sync per step) and steps unless one is set. ``DynamicGradScaler`` overrides it to keep that value.
GRAD_SCALER_SKIP_HOOK = "_maybe_opt_step"


def check_grad_scaler_skip_hook() -> None:
    """Raise if ``GradScaler._maybe_opt_step(optimizer, optimizer_state, ...)`` is gone (the override would not run)."""
    import inspect

    hook = getattr(torch.amp.GradScaler, GRAD_SCALER_SKIP_HOOK, None)
    params = list(inspect.signature(hook).parameters) if callable(hook) else []
    if params[:3] != ["self", "optimizer", "optimizer_state"]:
        raise RuntimeError(
            f"torch {torch.__version__}: torch.amp.GradScaler.{GRAD_SCALER_SKIP_HOOK}(optimizer, optimizer_state, ...)"
            " is gone or changed, and lit_accel's DynamicGradScaler relies on it to learn on the host that a step"
            " was skipped. Pin torch to a version lit_accel supports or update lit_accel."
        )


def optimizer_state_found_infs(optimizer_state: dict[str, Any]) -> list[torch.Tensor]:
    """The per-device found-inf flags in one ``GradScaler._per_optimizer_states`` entry."""
    return list(optimizer_state["found_inf_per_device"].values())


def grad_scaler_found_infs(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """Every found-inf flag recorded since the last ``update()`` (all optimizers, all devices), without a host sync."""
    return [flag for state in scaler._per_optimizer_states.values() for flag in optimizer_state_found_infs(state)]


def reset_grad_scaler_iteration(scaler: torch.amp.GradScaler) -> None:
    """Forget the per-optimizer stages and found-inf flags, as ``update()`` does (a disabled scaler has none)."""
    if scaler.is_enabled():
        scaler._per_optimizer_states.clear()  # a defaultdict: clear() keeps its factory


#: Where ``DynamicGradScaler._maybe_opt_step`` keeps torch's host read of the flags: in the optimizer's iteration state
#: (``GradScaler._per_optimizer_states[id(optimizer)]``, a plain dict that ``update()`` drops with the rest).
HOST_FOUND_INF = "lit_accel_found_inf_on_host"


def grad_scaler_step_skipped(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
    """Whether ``scaler.step(optimizer)`` just skipped (ask before ``update()``), without a sync.

    A host bool where ``DynamicGradScaler`` kept torch's read (non-fused optimizers), else the 0-d device flag.
    """
    state = scaler._per_optimizer_states.get(id(optimizer)) if scaler.is_enabled() else None
    flags = optimizer_state_found_infs(state) if state is not None else []
    if not flags:
        return False
    summed = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()
    return state.get(HOST_FOUND_INF, summed)


def grad_scaler_host_found_inf(scaler: torch.amp.GradScaler) -> bool | None:
    """Whether a step since the last ``update()`` overflowed, where the host knows each optimizer's skip (else None)."""
    flagged = [state for state in scaler._per_optimizer_states.values() if state.get("found_inf_per_device")]
    known = [state.get(HOST_FOUND_INF) for state in flagged]
    return None if not known or None in known else any(known)


def reset_grad_scaler_tensors(scaler: torch.amp.GradScaler, device_type: str) -> None:
    """Drop the scale and tracker tensors (:func:`init_grad_scaler_tensors` recreates them) and set the device type."""
    scaler._scale = None
    scaler._growth_tracker = None
    scaler._device = device_type


def init_grad_scaler_tensors(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Create the scale and growth-tracker tensors on ``device`` now instead of at the first ``scale()`` call."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)


def grad_scaler_growth_tracker(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The int32 growth-tracker tensor (``GradScaler._growth_tracker``), read without a host sync."""
    return scaler._growth_tracker if scaler.is_enabled() else None


def optimizer_handles_amp_scaling(optimizer: object) -> bool:
    """Whether ``GradScaler.step`` hands the scale and found-inf flag to the optimizer (fused kernels).

    torch sets ``_step_supports_amp_scaling`` on ``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def optimizer_takes_grad_scaler(optimizer: object) -> bool:
    """Whether the optimizer unscales by itself, on torch's deprecated ``step(grad_scaler=...)`` contract.

    ``GradScaler.step`` then passes the scaler instead of setting ``grad_scale``/``found_inf`` on the optimizer.
    """
    import inspect

    step = getattr(optimizer, "step", None)
    return optimizer_handles_amp_scaling(optimizer) and "grad_scaler" in inspect.signature(step).parameters


def train_batch_idx(trainer: object) -> int:
    """The index of the current training batch within its epoch (``fit_loop.epoch_loop.batch_idx``)."""
    return trainer.fit_loop.epoch_loop.batch_idx  # type: ignore[attr-defined]


def batches_that_stepped(trainer: object) -> int:
    """Training batches that ended with an optimizer step so far: the ``step`` Lightning logs metrics with.

    Equal to ``global_step`` with one optimizer; with several optimizers stepping in one batch (manual optimization)
    ``global_step`` counts each, this counts the batch once. Lightning increments it after ``on_train_batch_end``, so
    inside that hook it is the index of the current batch's step, as for ``self.log``.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped  # type: ignore[attr-defined]


# --- Resume at an epoch boundary and the launcher (tests: tests/utilities/test_compat_reliability.py) ---


def load_pending_loader_states(trainer: object) -> bool:
    """Load a restored checkpoint's train loader states into a loader set up before the restore; True if it did.

    ``FitLoop.setup_data`` returns early when the loader exists, skipping ``_load_combined_loader_states`` and the new
    ``iter`` of the ``_data_fetcher`` that follows it: this does both, in that order. Used by ``_workarounds``.
    """
    fit_loop = trainer.fit_loop  # type: ignore[attr-defined]
    if not (fit_loop.restarting and fit_loop._combined_loader_states_to_load and fit_loop._combined_loader):
        return False
    fit_loop._load_combined_loader_states()
    if fit_loop._data_fetcher is not None:
        iter(fit_loop._data_fetcher)  # the iterator made before the states were loaded would ignore them
    return True


def clear_finished_epoch_restart(trainer: object) -> bool:
    """If the restored fit loop is "restarting" a finished epoch, clear that flag (``_Loop.restarting``'s base setter).

    Lightning 2.6 keeps the fit loop restarting after any load when ``max_steps`` is set (``FitLoop.restarting``'s
    setter ORs in ``_iteration_based_training()``). A finished epoch is one whose batches all ran and whose last
    batch completed (``epoch_progress``/``batch_progress`` counters); a state that is not (mid-epoch,
    mid-validation, saved at ``on_train_batch_end``) is left alone. The base setter clears this loop and its
    children, as loading with ``max_epochs`` does; ``_loaded_from_state_dict`` stays set, so ``FitLoop.reset()``
    still completes the saved epoch. Used by ``_workarounds.resume_finished_epoch``. True when the flag was cleared.
    """
    from lightning.pytorch.loops.loop import _Loop

    fit_loop = trainer.fit_loop  # type: ignore[attr-defined]
    if not fit_loop.restarting:
        return False
    epoch = fit_loop.epoch_progress.current
    batches = fit_loop.epoch_loop.batch_progress
    batch = batches.current
    epoch_finished = epoch.ready == epoch.started == epoch.processed  # processed: all batches ran, end hooks may not
    last_batch_done = batches.is_last_batch and batch.ready == batch.started == batch.processed == batch.completed
    if not (epoch_finished and last_batch_done):
        return False
    _Loop.restarting.fset(fit_loop, False)
    return True


def launched_child_processes(strategy: object) -> list[tuple[int, Any]]:
    """``(local rank, Popen)`` of the ranks this process started with Lightning's subprocess launcher.

    ``_SubprocessScriptLauncher.procs`` holds the ``Popen`` of local ranks 1..N-1 in order; it is empty on other ranks
    and when the processes were started externally (torchrun, SLURM), and absent for other launchers.
    """
    procs = getattr(getattr(strategy, "launcher", None), "procs", None) or []
    return [(index + 1, proc) for index, proc in enumerate(procs)]


# --- FSDP2 and Lightning's FSDP2 strategy, used by AccelFSDP (tests: tests/utilities/test_compat_fsdp.py) ---


def fsdp_comm_base_classes() -> tuple[type, type]:
    """FSDP2's ``(AllGather, ReduceScatter)`` interfaces for ``FSDPModule.set_custom_all_gather/reduce_scatter``.

    The setters are public; the base classes live in the private ``torch.distributed.fsdp._fully_shard._fsdp_api``.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def composable_checkpoint() -> Any:
    """``torch.distributed._composable.checkpoint``: activation checkpointing of a module without wrapping it.

    Unlike ``checkpoint_wrapper``, the module tree and ``state_dict`` keys are unchanged, and it composes with
    ``fully_shard`` (torchtitan applies it per block before sharding).
    """
    from torch.distributed._composable import checkpoint

    return checkpoint


def set_model_parallel_sizes(strategy: object, data_parallel: int, tensor_parallel: int) -> None:
    """Set ``ModelParallelStrategy``'s mesh sizes (``_data_parallel_size``/``_tensor_parallel_size``) before its setup.

    Its ``"auto"`` data-parallel size is the node count, which on one node gives a 1-rank FSDP mesh (no sharding).
    """
    strategy._data_parallel_size = data_parallel  # type: ignore[attr-defined]
    strategy._tensor_parallel_size = tensor_parallel  # type: ignore[attr-defined]


def strategy_launcher(strategy: Any, start_method: str) -> Any:
    """The launcher ``DDPStrategy._configure_launcher`` would build for ``start_method``.

    Lightning's subprocess script launcher for ``"popen"``, its ``_MultiProcessingLauncher`` otherwise.
    """
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    if start_method == "popen":
        return _SubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    return _MultiProcessingLauncher(strategy, start_method=start_method)


def materialize_distributed_module(module: Any, device: Any) -> None:
    """Lightning's ``_materialize_distributed_module``: allocate meta-device parameters (empty init) on ``device``."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Lightning's ``_optimizers_to_device``: move optimizer state tensors to ``device``."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


# --- DDP's built-in logging, read by AccelDDP's hookless comm stats (tests: tests/utilities/test_compat_strategies.py)


def ddp_logging_data(ddp: object) -> dict[str, int | str]:
    """``DistributedDataParallel._get_ddp_logging_data()``: DDP's own construction and runtime statistics (torch 2.14).

    Read here: ``bucket_sizes`` (bytes per bucket, ``"a, b, ..."``), ``rebuilt_bucket_sizes`` (in gradient-ready order,
    from the third synchronised forward), ``comm_hook`` (with a hook), :func:`ddp_sampled_round`'s. Logging steps only.
    """
    return ddp._get_ddp_logging_data()  # type: ignore[attr-defined]


def set_ddp_sample_rate(ddp: object, every: int) -> None:
    """Let DDP time every ``every``-th synchronised iteration and the first ten (torch's default: every 100th)."""
    ddp._set_ddp_runtime_logging_sample_rate(every)  # type: ignore[attr-defined]


def ddp_sampled_round(ddp: object) -> tuple[int, float, float] | None:
    """``(iteration, comm_s, overlap_s)`` of DDP's latest sampled synchronised backward (published at the next one).

    ``backward_comm_time``: from the first bucket's collective launch to the end of ``finalize_backward`` (which waits
    for every bucket); ``backward_compute_comm_overlap_time``: from that launch to the end of the backward's compute.
    """
    data, keys = ddp_logging_data(ddp), ("iteration", "backward_comm_time", "backward_compute_comm_overlap_time")
    return (int(data[keys[0]]), int(data[keys[1]]) / 1e9, int(data[keys[2]]) / 1e9) if keys[1] in data else None


def ddp_bucket_sizes(ddp: Any, rebuilt: bool) -> tuple[int, ...] | None:
    """Bytes of each of DDP's gradient buckets: the layout built at construction, or the one it rebuilt.

    From :func:`ddp_logging_data` (``bucket_sizes``, ``rebuilt_bucket_sizes``). Before DDP has published the rebuilt
    layout (at the synchronised forward after the rebuild), the current one is read from the reducer: call it with
    ``rebuilt=True`` only once DDP has rebuilt (``Reducer._get_zeros_like_grad_buckets`` allocates zeroed buckets).
    """
    text = ddp_logging_data(ddp).get("rebuilt_bucket_sizes" if rebuilt else "bucket_sizes")
    if text:
        return tuple(int(part) for part in str(text).split(","))
    if not rebuilt:
        return None
    buffers = [bucket.buffer() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]
    return tuple(b.numel() * b.element_size() for b in buffers)


# --- HangWatchdog's side channel (tests: tests/utilities/test_compat_watchdog.py) ---


def default_process_group_store() -> Any:
    """The key-value store of the default process group, or None without one (``distributed_c10d._get_default_store``).

    ``init_process_group`` creates it (a ``TCPStore`` for ``env://``/``tcp://`` and under torchrun, a ``FileStore``
    for ``file://``) and wraps it in ``PrefixStore``s. ``ProgressWatchdog`` exchanges the ranks' states through it:
    the store keeps answering while the process group's collectives are blocked.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# --- Observability: the end of a backward pass and torch.compile's counters (tests:
# tests/utilities/test_compat_observability.py)


def queue_backward_callback(callback: Any) -> bool:
    """Run ``callback()`` when the running backward pass ends (``Variable._execution_engine.queue_callback``).

    The autograd engine runs queued callbacks after the last backward op of the pass, in the order they were queued;
    DDP's reducer queues its ``finalize_backward`` (which waits for the buckets' collectives) when its last bucket is
    ready, so a callback queued from a DDP comm hook runs first: at the end of the backward's own compute. Returns
    ``False`` (and queues nothing) outside a backward pass.
    """
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def dynamo_compile_counts() -> tuple[int, int]:
    """``(compilations, recompilations)`` torch.compile made in this process (``convert_frame.FRAME_COMPILE_COUNTER``).

    Dynamo counts the compilations of each frame (a code object); every one after a frame's first is a recompilation
    (a guard failed: a new shape, dtype or Python value). ``(0, 0)`` if ``torch._dynamo`` was never imported.
    """
    import sys

    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is None:
        return 0, 0
    counts = list(convert_frame.FRAME_COMPILE_COUNTER.values())
    return sum(counts), sum(max(0, c - 1) for c in counts)


def dynamo_graph_count() -> int:
    """The graphs torch.compile handed to a backend in this process (``utils.counters["stats"]["unique_graphs"]``)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def current_graph_task_id() -> int:
    """The id of the backward pass running on this thread, -1 outside one (``torch._C._current_graph_task_id``).

    Tells the buckets of one backward from the next one's, also after a backward that raised before its end.
    """
    return int(torch._C._current_graph_task_id())
