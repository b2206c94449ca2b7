"""``BatchPlanner``: the Lightning side of the batch plan, resolved once per fit before ``configure_optimizers``.

Lightning itself loads the train dataloader inside ``configure_optimizers`` when ``trainer.estimated_stepping_batches``
is read (``fit_loop.setup_data()``), so a strategy can do the same at the start of its ``setup``, where the process
group exists and ``configure_optimizers`` has not run: read the loader's batch size, agree on it across the
data-parallel ranks (one all-reduce), make the :class:`~lit_accel.layout.batch_plan.BatchPlan`, write
``trainer.accumulate_grad_batches`` once and announce the plan once. The estimate is then the number of optimizer
steps the run takes. The data-parallel size and group are arguments: a strategy with a mesh passes its data dimension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_accel.layout.batch_plan import BatchPlan, loaded_batch_size_of, make_batch_plan
from lit_accel.utilities._validation import check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BatchPlanner"]


class _Where(NamedTuple):
    """What :meth:`BatchPlanner.resolve` was told about the ranks and the split, for reloads."""

    ranks: int = 1
    group: Any = None
    device: torch.device = torch.device("cpu")
    even: bool = False
    count: int | None = None  # micro-batches per loaded batch (a pipeline's), instead of micro_batch_size


class BatchPlanner:
    """Resolves, applies and announces a strategy's :class:`BatchPlan`; the one writer of the Trainer's accumulation.

    Args:
        owner: the strategy's class name, for messages.
        global_batch_size: samples per optimizer step over all data-parallel ranks; ``None`` keeps the Trainer's
            ``accumulate_grad_batches``.
        micro_batch_size: the chunk size loaded batches are split into, ``"auto"`` (found at the first batch and set
            with :meth:`choose_micro_batch_size`) or ``None``.

    Example::

        planner = BatchPlanner("MyStrategy", global_batch_size=1024, micro_batch_size=None)
        plan = planner.resolve(trainer, data_parallel_size=8, group=None, device=torch.device("cuda", 0))
    """

    def __init__(
        self, owner: str, global_batch_size: int | None, micro_batch_size: int | Literal["auto"] | None
    ) -> None:
        check_int(owner, "global_batch_size", global_batch_size, allow_none=True, example=1024)
        if micro_batch_size != "auto":
            check_int(owner, "micro_batch_size", micro_batch_size, allow_none=True, example=32)
        self.owner = owner
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        #: The plan of the running fit (``None`` before it is known).
        self.plan: BatchPlan | None = None
        self._user_accumulation = 1  # the Trainer's setting before the plan wrote it
        self._written: int | None = None  # the accumulation this planner wrote to the Trainer
        self._loader: Any = None  # the train dataloader(s) the plan was read from
        self._where = _Where()

    def resolve(
        self,
        trainer: pl.Trainer,
        *,
        data_parallel_size: int,
        group: Any = None,
        device: torch.device,
        even_micro_batches: bool = False,
        micro_batches: int | None = None,
    ) -> BatchPlan | None:
        """At the start of the strategy's ``setup``: the plan of this fit, applied and announced (``None``: not known).

        With ``global_batch_size``, ``micro_batch_size`` or ``micro_batches`` (the strategy's count of equal
        micro-batches per loaded batch, e.g. a pipeline's; it wins over ``micro_batch_size``; ``even_micro_batches``: a
        pipeline's split, whose step takes one loaded batch, so no accumulation) the train dataloader is
        loaded now (as ``estimated_stepping_batches`` would); a global batch size is agreed on by the ``group``'s
        ranks, and every rank raises the same error for a plan that cannot be made. With none, there is no plan.
        """
        self.plan, self._loader = None, None
        self._where = _Where(data_parallel_size, group, device, even_micro_batches, micro_batches)
        if trainer.state.fn != TrainerFn.FITTING:
            return None
        if trainer.accumulate_grad_batches != self._written:  # a value this planner wrote is not the user's
            self._user_accumulation = trainer.accumulate_grad_batches
        if self.global_batch_size is None and self.micro_batch_size is None and micro_batches is None:
            return None
        if self.global_batch_size is not None and any(
            isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks
        ):
            raise ValueError(
                f"{self.owner}(global_batch_size={self.global_batch_size}) sets the accumulation itself, which"
                " contradicts the GradientAccumulationScheduler callback. Fix: drop one of them."
            )
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # Lightning's own way to the loader before configure_optimizers
        return self._read(trainer)

    def check_reload(self, trainer: pl.Trainer) -> None:
        """Before each batch: a reloaded train dataloader (``reload_dataloaders_every_n_epochs``) must fit the plan."""
        if self.plan is not None and trainer.train_dataloader is not self._loader:
            planned = self.plan
            plan = self._read(trainer, first=False)
            if plan is not None and plan.accumulate_grad_batches != planned.accumulate_grad_batches:
                raise ValueError(
                    f"{self.owner}: the reloaded train dataloader's batch_size={plan.loaded_batch_size} changes the"
                    f" plan ({planned.describe()}), on which the step count and schedulers rest. Fix: keep"
                    f" batch_size={planned.loaded_batch_size} when reloading."
                )
            if plan is not None and self._where.count is not None:
                self.plan = plan  # split into the same count
            elif plan is not None and planned.micro_batch_size < plan.loaded_batch_size:
                self.plan = plan.with_micro_batch_size(planned.micro_batch_size)  # an "auto" choice stays

    def choose_micro_batch_size(self, size: int, report: str | None = None) -> BatchPlan | None:
        """Record the micro-batch ``"auto"`` chose (the same int on every rank); announce it once, with ``report``."""
        if self.plan is not None:
            self.plan = self.plan.with_micro_batch_size(size)
        described = f"; {self.plan.describe()}" if self.plan is not None else ""
        tried = f" ({report})" if report else ""
        rank_zero_info(f"{self.owner}: micro_batch_size='auto' chose {size}{tried}{described}")
        return self.plan

    def _read(self, trainer: pl.Trainer, first: bool = True) -> BatchPlan | None:
        ranks, group, device, even, count = self._where
        self._loader = loaders = trainer.train_dataloader
        if loaders is None:
            return None  # no training (limit_train_batches=0, no training_step): nothing to plan
        loaded = loaded_batch_size_of(loaders)
        if self.global_batch_size is not None:
            loaded = self._agreed(loaded, group, device)
        elif loaded is None:
            return None  # the batches are split as they come; the global batch is not known
        micro = None if self.micro_batch_size == "auto" else self.micro_batch_size
        accumulation = trainer.accumulate_grad_batches if self.global_batch_size is None else self._user_accumulation
        plan = make_batch_plan(
            self.global_batch_size, loaded, ranks, micro,
            accumulate_grad_batches=accumulation, even_micro_batches=even, micro_batches=count,
            accumulates=not even, owner=self.owner,
        )  # fmt: skip
        module = trainer.lightning_module
        if plan.accumulate_grad_batches > 1 and not module.automatic_optimization:
            # Lightning's manual loop ignores the setting: every opt.step() would still see one loaded batch per rank.
            raise ValueError(
                f"{self.owner}(global_batch_size={plan.global_batch_size}) needs accumulate_grad_batches="
                f"{plan.accumulate_grad_batches}, but {type(module).__name__} uses manual optimization, where"
                f" Lightning does not accumulate. Fix: use global_batch_size={loaded * ranks}, or accumulate in your"
                " training_step."
            )
        if not first:
            return plan  # a reload: checked against the plan, which stays the fit's
        if self.global_batch_size is not None:
            trainer.accumulate_grad_batches = self._written = plan.accumulate_grad_batches  # once per fit
        self.plan = plan
        rank_zero_info(f"{self.owner}: {plan.describe()}")
        return plan

    def _agreed(self, loaded: int | None, group: Any, device: torch.device) -> int:
        """The batch size every rank of ``group`` read, with one all-reduce; the same error on every rank else."""
        largest = smallest = loaded or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            # max over ranks of (m, -m) gives the largest and the smallest (0: unreadable there)
            extremes = torch.tensor([largest, -largest], device=device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            largest, smallest = int(extremes[0]), -int(extremes[1])
        name = f"{self.owner}(global_batch_size={self.global_batch_size})"
        if largest != smallest:
            raise ValueError(
                f"{name}: the train dataloaders' batch sizes differ between ranks (from {smallest or 'unreadable'} to"
                f" {largest}), so no accumulation fits all of them. Fix: give every rank the same batch_size."
            )
        if largest == 0:
            raise ValueError(
                f"{name}: the train dataloader has no batch_size (batch_size or batch_sampler.batch_size), so the"
                " accumulation cannot be planned before training. Fix: give the DataLoader a batch_size, or drop"
                " global_batch_size and set Trainer(accumulate_grad_batches=...)."
            )
        return largest
