"""``MemoryMonitor``: the Lightning adapter of :class:`~lit_accel.meters.MemoryMeter`."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_accel.meters.memory import MemoryMeter
from lit_accel.meters.plots import memory_figure, save_report
from lit_accel.meters.tables import memory_table, stage_table
from lit_accel.protocols import PipelineStages, StagePlacement
from lit_accel.utilities._compat import batches_that_stepped
from lit_accel.utilities._idle_hooks import idle, idle_unused, wake
from lit_accel.utilities._validation import check_bool

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = ["MemoryMonitor"]


class MemoryMonitor(Callback):
    """Log where memory goes on each rank: parameters, gradients, optimizer state, activations, CUDA peaks.

    Works with any strategy (local shards under FSDP2). Sizes are tensor metadata, read at logging steps only (the
    Trainer's ``log_every_n_steps``; gradients and optimizer state just before that step's optimizer step):
    no host sync, no per-step work. Activations are the saved-tensor bytes of the first training micro-batch's
    forward. Every rank measures, one ``all_gather`` per logging step collects them, and rank 0's loggers get the
    maximum over ranks at the step of that step's own metrics. At the end of fit rank 0 prints a table (with what
    sharding and autocast saved) and writes ``report_path`` (JSON).

    Keys (after ``log_key_prefix``; MB = 1e6 bytes): ``params_mb``, ``grads_mb``, ``optimizer_mb``,
    ``activations_mb``, ``param_casts_mb`` (autocast's saved parameter copies), on CUDA ``peak_allocated_mb``,
    ``peak_reserved_mb``, ``alloc_retries``, ``ooms``; ``<name>_spread`` (max / min over ranks, e.g.
    ``params_spread``) where ranks differ. Under a pipeline (a strategy with ``PipelineStages``) also
    ``stage{k}/<name>_mb``: the maximum over the ranks of pipeline rank ``k`` (which holds stage ``k``, and more
    under interleaved and V schedules), in the table and the report too. Keys and formulas: ``docs/monitors.md``.

    Args:
        report_path: where rank 0 writes the JSON report (``None``: no file).
        print_summary: print the table at the end of fit.
        measure_activations: measure one forward's saved tensors (off for models whose forward must run unhooked).
        log_key_prefix: prefix of every key.

    Raises:
        TypeError: an argument of the wrong type.

    Example::

        monitor = MemoryMonitor(report_path="runs/memory.json")
        trainer = Trainer(accelerator="gpu", devices=8, strategy=AccelFSDP(), callbacks=[monitor])
        trainer.fit(model, datamodule=dm)
        print(monitor.summary["params_mb"], monitor.summary.get("sharding_saved_mb"))
    """

    def __init__(
        self,
        *,
        report_path: str | os.PathLike[str] | None = None,
        print_summary: bool = True,
        measure_activations: bool = True,
        log_key_prefix: str = "mem/",
    ) -> None:
        name = type(self).__name__
        if report_path is not None and not isinstance(report_path, (str, os.PathLike)):
            raise TypeError(f"{name}(report_path={report_path!r}): expected a path or None. Fix: 'runs/memory.json'.")
        check_bool(name, "print_summary", print_summary)
        check_bool(name, "measure_activations", measure_activations)
        if not isinstance(log_key_prefix, str):
            raise TypeError(f"{name}(log_key_prefix={log_key_prefix!r}): expected a str. Fix: pass e.g. 'mem/'.")
        self.report_path = None if report_path is None else Path(report_path)
        self.print_summary = print_summary
        self.measure_activations = measure_activations
        self.log_key_prefix = log_key_prefix
        #: The last metrics and what each lever saved, on every rank, after fit.
        self.summary: dict[str, float] = {}
        #: The JSON report, on every rank, after fit.
        self.report: dict[str, Any] = {}
        self.meter: MemoryMeter | None = None
        self._placement: StagePlacement | None = None
        self._skip_batches = 0  # training batches to pass before measuring activations
        self._step_label = 0
        self._logged_label: int | None = None
        self._last_step = 0  # global step at the end of the previous batch (a batch that moves it stepped)
        self._awake_before_step = True  # whether Lightning dispatches on_before_optimizer_step now
        idle_unused(self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self._placement = strategy.pipeline_stages if isinstance(strategy, PipelineStages) else None
        stage = None if self._placement is None else self._placement.pipeline_rank  # gathered with the rows
        self.meter = MemoryMeter(strategy.root_device, world_size=trainer.world_size, stage=stage)
        self._step_label, self._logged_label = batches_that_stepped(trainer), None
        self._last_step = trainer.global_step
        # a pipeline's first step also runs torch's shape inference (one more forward and backward): the next one
        self._skip_batches = 0 if self._placement is None else 1
        self._measuring(self.measure_activations)
        wake(self, "on_before_optimizer_step")  # whatever an earlier fit left
        self._awake_before_step = True
        self._before_logging_steps(self._step_label, trainer.log_every_n_steps)

    def _measuring(self, activations: bool) -> None:
        """The hooks around the forward run only while one forward's activations are to be measured."""
        hooks = ("on_train_batch_start", "on_before_backward")
        if activations:
            wake(self, *hooks)
        else:
            idle(self, MemoryMonitor, *hooks)

    def _logging_step(self, trainer: pl.Trainer) -> bool:
        every = trainer.log_every_n_steps
        return bool(every) and (batches_that_stepped(trainer) + 1) % every == 0

    def _before_logging_steps(self, steps: int, every: int) -> None:
        """``on_before_optimizer_step`` runs only when the next batch may log (Lightning's dispatch skips it otherwise).

        ``steps``: ``batches_that_stepped`` now; whether Lightning counts this batch too is known only after
        ``on_train_batch_end``, so both candidates wake it.
        """
        soon = bool(every) and ((steps + 1) % every == 0 or (steps + 2) % every == 0)
        if soon is not self._awake_before_step:
            self._awake_before_step = soon
            if soon:
                wake(self, "on_before_optimizer_step")
            else:
                idle(self, MemoryMonitor, "on_before_optimizer_step")

    # ------------------------------------------------------------------ per-step path

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.meter is not None
        if self._skip_batches:
            self._skip_batches -= 1
        elif self.measure_activations and not self.meter.activations_measured:
            self.meter.start_activations(pl_module)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        assert self.meter is not None
        # the forward's saved tensors (the backward's recomputation is not held); a pipeline's, of every micro-batch
        placement = trainer.strategy.pipeline_stages if self._placement is not None else None
        self.meter.stop_activations(1 if placement is None else placement.microbatches)
        if self.meter.activations_measured:
            self._measuring(False)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        assert self.meter is not None
        if self._logging_step(trainer):  # gradients reduced and complete; not yet zeroed
            self.meter.record_state(pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        meter = self.meter
        assert meter is not None
        meter.stop_activations()  # a batch without backward (training_step returned None)
        steps, every = batches_that_stepped(trainer), trainer.log_every_n_steps
        self._before_logging_steps(steps, every)
        global_step = trainer.global_step
        if global_step == self._last_step:
            return  # no optimizer step in this batch (accumulation)
        self._last_step = global_step
        self._step_label = steps  # this step's index; Lightning increments it after this hook
        if every and (steps + 1) % every == 0:
            self._log(trainer, meter.compute(step=steps))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.meter is not None:
            self.meter.stop_activations()

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        self._logged_label = self._step_label
        if metrics and trainer.is_global_zero and trainer.log_every_n_steps:  # 0: Lightning logs nothing
            prefixed = {self.log_key_prefix + k: v for k, v in metrics.items()}
            for logger in trainer.loggers:
                logger.log_metrics(prefixed, step=self._step_label)

    # ------------------------------------------------------------ end of fit

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        meter = self.meter
        assert meter is not None
        if not meter.state_recorded:  # no logging step ran: the state the last step left (grads not zeroed since)
            for optimizer in trainer.optimizers or [None]:
                meter.record_state(pl_module, optimizer)
        metrics = meter.compute(step=self._step_label)  # on every rank: it gathers
        if self._logged_label != self._step_label:
            self._log(trainer, metrics)
        self.summary = meter.summary()
        title, held = self._report(trainer, meter)
        if trainer.is_global_zero and self.report_path is not None:
            figure = partial(memory_figure, meter.history, title, trainer.world_size)
            save_report(self.report_path, self.report, figure, "MemoryMonitor", rank_zero_info)
        if trainer.is_global_zero and self.print_summary:
            self._print_tables(meter, title, held)

    def _report(self, trainer: pl.Trainer, meter: MemoryMeter) -> tuple[str, Any]:
        """The end-of-fit report (with the run's configuration), its title, and the stages each pipeline rank held."""
        self.report = meter.report()
        strategy = type(trainer.strategy).__name__
        self.report["config"].update(strategy=strategy, precision=str(trainer.precision))
        held = () if self._placement is None else self._placement.stages
        if held:
            self.report["config"]["pipeline_stages"] = [list(stages) for stages in held]
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return f"MemoryMonitor: {name} x{trainer.world_size}, {trainer.precision}, {strategy}", held

    def _print_tables(self, meter: MemoryMeter, title: str, held: Any) -> None:
        """Rank 0's end-of-fit tables: per rank, then per pipeline stage when there is a pipeline."""
        from rich.console import Console

        console = Console()
        console.print(memory_table(meter.rows, self.summary, title))
        if "per_stage" in self.report:
            console.print(stage_table(self.report["per_stage"], held))
