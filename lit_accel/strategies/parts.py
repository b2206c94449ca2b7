"""``AccelParts``: the strategy-independent parts of a lit_accel strategy, wired into Lightning's strategy hooks.

A strategy lists it before its Lightning base class (``class AccelDDP(AccelParts, DDPStrategy)``) and calls
:meth:`AccelParts._init_parts` from its constructor. It then gets, without copying any of it: the global-batch rule
and the exact partial window (:class:`~lit_accel.strategies._global_batch.GlobalBatch`), SyncBatchNorm on every
backend (:class:`~lit_accel.strategies._batchnorm_sync.BatchNormSync`), the finished-epoch resume fix, and the
peer-failure explanation. What differs between strategies (how gradients are reduced, counted and skipped) stays in
the strategy; ``docs/extending.md`` shows a new strategy built this way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_accel.callbacks.hang_watchdog import HangWatchdog
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm, is_synced_batchnorm
from lit_accel.strategies._batch_planner import BatchPlanner
from lit_accel.strategies._batchnorm_sync import BatchNormSync
from lit_accel.strategies._compile import ForwardCompilation, check_compile, compile_targets
from lit_accel.strategies._micro_batches import MicroBatchChange, MicroBatching
from lit_accel.strategies._partial_window import PartialWindow
from lit_accel.strategies._peer_failure import explain_peer_failure, is_peer_loss
from lit_accel.utilities._compat import get_layer_sync, launched_child_processes, set_layer_sync
from lit_accel.utilities._validation import check_number
from lit_accel.utilities._workarounds import resume_finished_epoch, resume_loader_states

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.optim import Optimizer

    from lit_accel.strategies._fsdp_recovery import CollectiveLedger
    from lit_accel.strategies.batch_plan import BatchPlan

__all__ = ["AccelParts"]


class AccelParts:
    """Mixin for a ``ParallelStrategy`` subclass: global batch, partial window, SyncBN, resume fix, peer failures.

    Example::

        class MyStrategy(AccelParts, DDPStrategy):
            def __init__(self, *, global_batch_size=None, sync_batchnorm=True, **kwargs):
                super().__init__(**kwargs)
                self._init_parts("MyStrategy", global_batch_size=global_batch_size, sync_batchnorm=sync_batchnorm)
    """

    if TYPE_CHECKING:  # provided by the Lightning strategy this is mixed into
        world_size: int
        node_rank: int
        num_processes: int
        root_device: torch.device
        lightning_module: pl.LightningModule | None
        lr_scheduler_configs: list[Any]

    #: Registry names and their launch methods, for ``register_strategies`` (e.g. ``{"accel_ddp": "popen"}``).
    registry_names: dict[str, str] = {}  # noqa: RUF012 - a class-level table, replaced by each strategy

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy under each of its :attr:`registry_names` (idempotent: present names are kept)."""
        for name, start_method in cls.registry_names.items():
            if name not in strategy_registry:
                description = f"{cls.__name__} with start_method {start_method!r}"
                strategy_registry.register(name, cls, description=description, start_method=start_method)

    def _init_parts(
        self,
        owner: str,
        global_batch_size: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool | AccelSyncBatchNorm = True,
        hang_timeout: float | None = 30.0,
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        options = check_compile(owner, compile)
        self._compilation = None if options is None else ForwardCompilation(owner, options)
        if hang_timeout is not None:
            check_number(owner, "hang_timeout", hang_timeout, fix="pass seconds without progress, or None for none")
        self._hang_timeout = None if hang_timeout is None else float(hang_timeout)
        auto = micro_batch_size == "auto"
        if isinstance(micro_batch_size, str) and not auto:
            raise ValueError(f"{owner}(micro_batch_size={micro_batch_size!r}): expected an int or 'auto'. Fix: 'auto'.")
        self._planner = BatchPlanner(owner, global_batch_size, micro_batch_size)
        self._window = PartialWindow(owner, partial_window)
        self._batchnorm_sync = BatchNormSync(owner, sync_batchnorm)
        self._micro_batch_arg = micro_batch_size
        self._micro: MicroBatching | None = None  # set at fit start when loaded batches are split
        self._attached_trainer: pl.Trainer | None = None  # set in setup(); the strategy's hooks do not receive it

    @property
    def batch_plan(self) -> BatchPlan | None:
        """This fit's plan (global batch, loaded batch, micro-batches, accumulation), once known."""
        return self._planner.plan

    @property
    def partial_window(self) -> str:
        """How an epoch's last, short accumulation window is averaged: ``"mean"`` or ``"lightning"``."""
        return self._window.mode

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all devices: the plan's, else the configured value."""
        plan = self._planner.plan
        return plan.global_batch_size if plan is not None else self._planner.global_batch_size

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward on one device: the plan's, else the configured int."""
        if self._micro is not None and self._micro.size is not None:
            return self._micro.size
        plan, configured = self._planner.plan, self._planner.micro_batch_size
        return plan.micro_batch_size if plan is not None else configured if isinstance(configured, int) else None

    @property
    def micro_batch_changes(self) -> list[MicroBatchChange]:
        """Every change ``micro_batch_size="auto"`` made (optimizer step, old size, new size)."""
        return [] if self._micro is None else list(self._micro.changes)

    def _check_micro_batching(self, auto: bool) -> None:
        """Refuse what the strategy cannot split batches with (AccelDDP: auto with collectives in forward)."""

    def _forward_collective(self) -> str | None:
        """What in the model makes a collective of its own in forward (``"auto"`` cannot recover there), or None."""
        module, layer_sync = self.lightning_module, self._layer_sync
        if module is not None and any(is_synced_batchnorm(m) for m in module.modules()):
            return "SyncBatchNorm"
        if layer_sync is not None and not isinstance(layer_sync, (AccelSyncBatchNorm, TorchSyncBatchNorm)):
            return f"the LayerSync plugin {type(layer_sync).__name__}"  # a user's: it may sync any layer
        return None

    def _average_gradients(self) -> None:
        """Average the gradients over ranks now (after micro-batches whose backward all stayed local)."""
        raise NotImplementedError(f"{type(self).__name__} cannot average gradients outside its backward")

    def _collective_ledger(self) -> CollectiveLedger | None:
        """The ledger keeping collectives in step through a failed ``"auto"`` attempt (AccelFSDP); None: none needed."""
        return None

    def _reduce_in_attempt(self) -> AbstractContextManager[None]:
        """Gradient reduction on for the last micro-batch of an attempt that runs every backward (with a ledger)."""
        raise NotImplementedError(f"{type(self).__name__} has no collective ledger")

    def _prepare_backward_sync(self, output: Any) -> None:
        """Let the next backward reduce after a forward run under ``block_backward_sync`` (AccelDDP: the reducer)."""

    def _discard_gradients(self) -> None:
        """Drop the gradients of an attempt that failed (out of memory) on some rank."""
        for param in self.lightning_module.parameters():  # type: ignore[union-attr]
            param.grad = None

    @property
    def sync_bn_group_size(self) -> int | None:
        """Ranks per SyncBatchNorm group (``None``: all ranks)."""
        return self._batchnorm_sync.group_size

    def _check_accumulation(self, accumulation: int) -> None:
        """Refuse an accumulation the strategy cannot run (AccelDDP: ``static_graph``). Called when it is known."""

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_parts(trainer)
        super().setup(trainer)  # type: ignore[misc]

    def _setup_parts(self, trainer: pl.Trainer) -> None:
        """The parts' share of ``setup``: the accumulation when known, and which SyncBN plugin to apply."""
        self._attached_trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._add_hang_watchdog(trainer)
            # before configure_optimizers (in super().setup), so that estimated_stepping_batches counts real steps
            self._planner.resolve(trainer, data_parallel_size=self.world_size, device=self.root_device)
            self._check_accumulation(trainer.accumulate_grad_batches)
            layer_sync = self._batchnorm_sync.resolve(get_layer_sync(self), self.lightning_module, self.world_size)
            set_layer_sync(self, layer_sync)

    def _add_hang_watchdog(self, trainer: pl.Trainer) -> None:
        # The user's own HangWatchdog (first in trainer.callbacks) wins; the others' allowances stay at least timeout.
        timeout = self._hang_timeout
        if timeout is not None and not any(isinstance(cb, HangWatchdog) for cb in trainer.callbacks):
            longer = max(600.0, timeout)
            trainer.callbacks.append(HangWatchdog(timeout, longer, longer, longer))

    @override
    def on_train_start(self) -> None:
        trainer = self._attached_trainer
        assert trainer is not None
        plan = self._planner.at_train_start(trainer)
        self._window.new_fit()
        self._micro = self._micro_batching(plan)
        super().on_train_start()  # type: ignore[misc]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._planner.check_reload(self._attached_trainer)  # type: ignore[arg-type]
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def _micro_batching(self, plan: BatchPlan | None) -> MicroBatching | None:
        arg = self._micro_batch_arg
        if self._micro is not None and self._micro.auto:
            self._micro.new_fit()
            return self._micro  # a further fit keeps the size it learned
        if arg != "auto" and (arg is None or (plan is not None and plan.micro_batches == 1)):
            return None
        owner = type(self).__name__
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ValueError(
                f"{owner}(micro_batch_size={arg!r}) splits batches inside Lightning's automatic optimization, but"
                f" {type(module).__name__} uses manual optimization. Fix: drop micro_batch_size."
            )
        self._check_micro_batching(arg == "auto")
        return MicroBatching(owner, arg)  # type: ignore[arg-type]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # Lightning starts a window at batch_idx % k == 0 and forces a step on an epoch's last batch, so only that
        # window can be shorter than k.
        self._window.batch_started()
        if self._micro is not None:
            return self._micro.run(self, super().training_step, args[0], args[1:], kwargs)  # type: ignore[misc]
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._micro is not None:
            self._micro.restore_gradients()  # the earlier micro-batches' share, held over Lightning's zero_grad
        super().pre_backward(closure_loss)  # type: ignore[misc]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        trainer, module = self._attached_trainer, self.lightning_module
        accumulation = 1 if trainer is None else trainer.accumulate_grad_batches
        automatic = module is None or module.automatic_optimization
        closure = self._window.step(closure, optimizer, accumulation, automatic)
        if self._micro is not None:
            closure = _restoring(closure, self._micro)
        return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    @override
    def on_train_end(self) -> None:
        micro = self._micro
        if micro is not None and micro.auto:
            changes = ", ".join(f"step {c.step}: {c.old} -> {c.new}" for c in micro.changes) or "none"
            rank_zero_info(f"{type(self).__name__}: micro-batch {micro.size} per device (auto; changes: {changes}).")
        super().on_train_end()  # type: ignore[misc]

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        # Lightning restores the loops right before the optimizers: this is the first strategy hook after that.
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            resume_finished_epoch(trainer)
            resume_loader_states(trainer)  # the plan set the loader up before the loops were restored

    def _compile_blocks(self, model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
        """Compile the blocks' ``forward`` before the strategy wraps or shards ``model`` (``compile=`` set)."""
        if self._compilation is not None:
            self._compilation.apply(compile_targets(type(self).__name__, model, blocks))

    @override
    def teardown(self) -> None:
        if self._compilation is not None:
            self._compilation.revert()
        super().teardown()  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        # A rank that raised or was killed surfaces on the others as a transport error naming an address; say which
        # rank ended and how (rank 0 of a popen launch knows its children's exit codes and signals).
        if self.world_size > 1 and is_peer_loss(exception):
            first_rank = self.node_rank * self.num_processes
            children = [(first_rank + local, proc) for local, proc in launched_child_processes(self)]
            explain_peer_failure(exception, self.world_size, children)


def _restoring(closure: Callable[[], Any], micro: MicroBatching) -> Callable[[], Any]:
    """``closure``, then the held micro-batch gradients back (when Lightning skipped the backward)."""

    def run() -> Any:
        result = closure()
        micro.restore_gradients()
        return result

    return run
