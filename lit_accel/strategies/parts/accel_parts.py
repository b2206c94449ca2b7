"""``AccelParts``: the strategy-independent parts of a lit_accel strategy, owned by it and called from its own hooks.

A strategy builds one in its constructor (``self.parts = AccelParts("MyStrategy", ...)``) and calls it, explicitly,
from the Lightning hooks it overrides (the table in ``docs/extending.md``): the batch plan (``BatchPlanner``), the
exact partial window (``PartialWindow``), micro-batching (``MicroBatching``, which reaches the strategy only through
the ``MicroBatchHost`` protocol), SyncBatchNorm on every backend, per-block compilation, the hang watchdog, the resume
fixes and the peer-failure explanation. What differs between strategies
(how gradients are reduced, counted and skipped) stays in the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.trainer.states import TrainerFn

from lit_accel.callbacks.hang_watchdog import add_hang_watchdog
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm, is_synced_batchnorm
from lit_accel.strategies.parts._batch_planner import BatchPlanner
from lit_accel.strategies.parts._batchnorm_sync import BatchNormSync
from lit_accel.strategies.parts._compile import ForwardCompilation, check_compile, compile_targets
from lit_accel.strategies.parts._micro_batch_trials import is_out_of_memory
from lit_accel.strategies.parts._micro_batches import MicroBatchHost, MicroBatching, out_of_memory_message
from lit_accel.strategies.parts._partial_window import PartialWindow
from lit_accel.strategies.parts._peer_failure import explain_peer_failure, is_peer_loss
from lit_accel.utilities._compat import get_layer_sync, launched_child_processes, set_layer_sync
from lit_accel.utilities._rank_errors import say_once
from lit_accel.utilities._validation import check_number
from lit_accel.utilities._workarounds import resume_finished_epoch, resume_loader_states

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ParallelStrategy
    from torch.optim import Optimizer

    from lit_accel.layout.batch_plan import BatchPlan

__all__ = ["AccelParts", "register_names", "serves_parts_attributes"]

_T = TypeVar("_T")


_SERVED = ("batch_plan", "global_batch_size", "micro_batch_size", "partial_window", "sync_bn_group_size")


def serves_parts_attributes(cls: type[_T]) -> type[_T]:
    """Class decorator: the strategy serves its ``parts``' read-only attributes of these names as its own.

    ``batch_plan``, ``global_batch_size``, ``micro_batch_size``, ``partial_window``, ``sync_bn_group_size``: documented
    on :class:`AccelParts`.
    """
    for name in _SERVED:
        served = getattr(AccelParts, name)
        setattr(cls, name, property(lambda strategy, name=name: getattr(strategy.parts, name), doc=served.__doc__))
    return cls


def register_names(cls: type, names: Mapping[str, str], strategy_registry: Any) -> None:
    """Register ``cls`` under each name of ``names`` (name -> start method); names already there are kept."""
    for name, start_method in names.items():
        if name not in strategy_registry:
            description = f"{cls.__name__} with start_method {start_method!r}"
            strategy_registry.register(name, cls, description=description, start_method=start_method)


class AccelParts:
    """Global batch, partial window, micro-batching, SyncBN, compile, watchdog, resume fixes, peer failures.

    Args:
        owner: the strategy's class name, for messages.
        global_batch_size, micro_batch_size, partial_window, sync_batchnorm, hang_timeout, compile: the strategy's
            arguments of these names (``AccelDDP``'s docstring).

    Example::

        class MyDDP(DDPStrategy):
            def __init__(self, *, global_batch_size=None, **kwargs):
                super().__init__(**kwargs)
                self.parts = AccelParts("MyDDP", global_batch_size=global_batch_size)

            def setup(self, trainer):
                self.parts.setup(self, trainer, data_parallel_size=self.world_size)
                super().setup(trainer)
    """

    def __init__(
        self,
        owner: str,
        global_batch_size: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool | AccelSyncBatchNorm = True,
        hang_timeout: float | None = None,
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        if isinstance(micro_batch_size, str) and micro_batch_size != "auto":
            raise ValueError(f"{owner}(micro_batch_size={micro_batch_size!r}): expected an int or 'auto'. Fix: 'auto'.")
        if hang_timeout is not None:
            check_number(owner, "hang_timeout", hang_timeout, fix="pass seconds without progress, or None")
        options = check_compile(owner, compile)
        self.owner = owner
        self.hang_timeout = None if hang_timeout is None else float(hang_timeout)
        self.compilation = None if options is None else ForwardCompilation(owner, options)
        self.planner = BatchPlanner(owner, global_batch_size, micro_batch_size)
        self.window = PartialWindow(owner, partial_window)
        self.batchnorm_sync = BatchNormSync(owner, sync_batchnorm)
        #: Micro-batching of the running fit (``None``: loaded batches run whole).
        self.micro: MicroBatching | None = None
        self._trainer: pl.Trainer | None = None  # the strategy's hooks do not receive it
        self._automatic = True  # the module's automatic_optimization, read once per fit

    @property
    def trainer(self) -> pl.Trainer | None:
        """The Trainer of the running fit (set in :meth:`setup`; the strategy's own hooks do not receive it)."""
        return self._trainer

    @property
    def batch_plan(self) -> BatchPlan | None:
        """This fit's :class:`~lit_accel.BatchPlan` (global batch, loaded batch, micro-batches, accumulation)."""
        return self.planner.plan

    @property
    def partial_window(self) -> str:
        """How an epoch's last, short accumulation window is averaged: ``"mean"`` or ``"lightning"``."""
        return self.window.mode

    @property
    def sync_bn_group_size(self) -> int | None:
        """Ranks per SyncBatchNorm group (``None``: all ranks)."""
        return self.batchnorm_sync.group_size

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all devices: the plan's, else the configured value."""
        plan = self.planner.plan
        return plan.global_batch_size if plan is not None else self.planner.global_batch_size

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward on one device: the plan's, else the configured int."""
        plan, configured = self.planner.plan, self.planner.micro_batch_size
        if plan is not None:
            return plan.micro_batch_size
        return self.micro.size if self.micro is not None else configured if isinstance(configured, int) else None

    # ------------------------------------------------------------------ called from the strategy's hooks

    def setup(
        self,
        strategy: ParallelStrategy,
        trainer: pl.Trainer,
        *,
        data_parallel_size: int,
        group: Any = None,
        micro_batches: int | None = None,
        splits_batches: bool = False,
    ) -> BatchPlan | None:
        """First in the strategy's ``setup``: the plan (before ``configure_optimizers``), micro-batching, the rest.

        Also an empty window, the watchdog and the SyncBN plugin. ``data_parallel_size``/``group``: the ranks that load
        different data. ``splits_batches``: the strategy runs the plan's micro-batches itself, which must then be equal
        (a pipeline schedule), in ``micro_batches`` per loaded batch if given; no ``MicroBatching`` then.
        """
        self._trainer = trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return None
        add_hang_watchdog(trainer, self.hang_timeout)  # report-only unless hang_timeout is set
        device, module = strategy.root_device, strategy.lightning_module
        self._automatic = module is None or module.automatic_optimization
        plan = self.planner.resolve(trainer, data_parallel_size=data_parallel_size, group=group, device=device,
                                    even_micro_batches=splits_batches, micro_batches=micro_batches)  # fmt: skip
        self.window.new_fit()
        self.micro = None if splits_batches else self._micro_batching(plan, module, strategy.num_processes)
        # BatchNorm statistics are synchronised over the ranks that see different samples: the data dimension
        set_layer_sync(strategy, self.batchnorm_sync.resolve(get_layer_sync(strategy), module, data_parallel_size))
        return plan

    def _micro_batching(
        self, plan: BatchPlan | None, module: pl.LightningModule | None, local_ranks: int
    ) -> MicroBatching | None:
        size = self.planner.micro_batch_size
        if size is None or (size != "auto" and plan is not None and plan.micro_batches == 1):
            return None
        if module is not None and not module.automatic_optimization:
            raise ValueError(
                f"{self.owner}(micro_batch_size={size!r}) splits batches inside Lightning's automatic optimization, but"
                f" {type(module).__name__} uses manual optimization. Fix: drop micro_batch_size."
            )
        return MicroBatching(self.owner, size, self.planner.choose_micro_batch_size, local_ranks)

    def training_step(self, host: MicroBatchHost, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The strategy's ``training_step``: the loaded batch counted and run, whole or as micro-batches."""
        trainer = self._trainer
        assert trainer is not None
        if self.planner.plan is not None:
            self.planner.check_reload(trainer)  # a reloaded train dataloader must fit the plan
        self.window.batch_started()
        if self.micro is None:
            return step(*args, **kwargs)
        return self.micro.run(host, step, trainer.accumulate_grad_batches, *args, **kwargs)

    def backward(self, backward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The strategy's ``backward``, with the earlier micro-batches' gradients back first.

        (They are held over Lightning's ``zero_grad``.) An out-of-memory error names the micro-batch that would fit.
        """
        micro = self.micro
        if micro is None:
            return backward(*args, **kwargs)
        micro.restore_gradients()
        try:
            return backward(*args, **kwargs)
        except Exception as err:
            if micro.size is None or not is_out_of_memory(err):
                raise
            raise RuntimeError(out_of_memory_message(self.owner, micro.size)) from err

    def optimizer_step(
        self, step: Callable[..., Any], optimizer: Optimizer, closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        """The strategy's ``optimizer_step``, with the closure that ends the window.

        It makes a short window exact, and puts the held gradients back when Lightning skipped the backward.
        """
        accumulation = 1 if self._trainer is None else self._trainer.accumulate_grad_batches
        closure = self.window.step(closure, optimizer, accumulation, self._automatic)
        result = step(optimizer, closure if self.micro is None else _restoring(closure, self.micro), *args, **kwargs)
        if self.compilation is not None:
            self.compilation.after_step()
        return result

    def loops_restored(self) -> None:
        """In ``load_optimizer_state_dict`` (the first strategy hook after Lightning restored the loops)."""
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            resume_finished_epoch(trainer)
            resume_loader_states(trainer)  # the plan set the loader up before the loops were restored

    def compile_blocks(self, owner: str, model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
        """Compile the blocks' ``forward`` before the strategy wraps or shards ``model`` (``compile=`` set)."""
        if self.compilation is not None:
            self.compilation.apply(compile_targets(owner, model, blocks))

    def teardown(self) -> None:
        """In ``teardown``: the eager ``forward`` back."""
        if self.compilation is not None:
            self.compilation.revert()

    def explain_failure(self, strategy: ParallelStrategy, exception: BaseException) -> None:
        """In ``on_exception``: a configuration error said once (rank 0), a peer's loss named (by its exit code)."""
        say_once(exception, strategy.global_rank, strategy.world_size)
        if strategy.world_size > 1 and is_peer_loss(exception):
            first_rank = strategy.node_rank * strategy.num_processes
            children = [(first_rank + local, proc) for local, proc in launched_child_processes(strategy)]
            explain_peer_failure(exception, strategy.world_size, children)

    @staticmethod
    def forward_collective(strategy: ParallelStrategy) -> str | None:
        """What makes a collective in the model's forward (SyncBatchNorm, a user's LayerSync), or None."""
        module, layer_sync = strategy.lightning_module, get_layer_sync(strategy)
        if module is not None and any(is_synced_batchnorm(m) for m in module.modules()):
            return "SyncBatchNorm"
        if layer_sync is not None and not isinstance(layer_sync, (AccelSyncBatchNorm, TorchSyncBatchNorm)):
            return f"the LayerSync plugin {type(layer_sync).__name__}"  # a user's: it may sync any layer
        return None


def _restoring(closure: Callable[[], Any], micro: MicroBatching) -> Callable[[], Any]:
    """``closure``, then the held micro-batch gradients back (when Lightning skipped the backward)."""

    def run() -> Any:
        result = closure()
        micro.restore_gradients()
        return result

    return run
