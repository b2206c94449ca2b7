"""AccelParallel: pipeline, tensor and sharded data parallel (3D) in the Lightning Trainer."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_accel.strategies import _fsdp_sharding as sharding
from lit_accel.strategies._backend import backend_for_device, check_backend_spec
from lit_accel.strategies._fsdp_comm import install_counting_comms
from lit_accel.strategies.parallel import _checks, _gradients
from lit_accel.strategies.parallel._batch import plan_pipeline_batch
from lit_accel.strategies.parallel._build import BuildConfig, ParallelModel, build_parallel_model
from lit_accel.strategies.parallel._layout import ParallelLayout
from lit_accel.strategies.parallel._pipeline import PipelineRunner
from lit_accel.strategies.parallel._schedules import SCHEDULES, ScheduleName
from lit_accel.strategies.parallel._stage import ParallelCommStats
from lit_accel.strategies.parallel._tensor_plan import TensorPlan
from lit_accel.strategies.parallel._training import OneStageBatch
from lit_accel.utilities import _compat
from lit_accel.utilities._workarounds import resume_finished_epoch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lit_accel.protocols import CommStats

__all__ = ["AccelParallel"]

_START_METHODS = {"accel_parallel": "popen", "accel_parallel_spawn": "spawn"}
_PARAM_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp8-mixed": torch.bfloat16}


class AccelParallel(ModelParallelStrategy):
    """Pipeline x data (FSDP2, optionally replicated) x tensor parallel training of your own LightningModule.

    The world is a mesh ``(pipeline, data_replicate, data_shard, tensor)``; the data-sharded size is what the other
    sizes leave. With a pipeline dimension the model is split into stages at its units (``docs/strategies.md``),
    each rank keeps its own (names unchanged, so sharded checkpoints move between layouts), and one optimizer step
    is one ``schedule.step()`` over the loaded batch split into micro-batches; the LightningModule then defines
    ``pipeline_loss(output, target)`` (the mean loss of a micro-batch) instead of ``training_step``. Without one,
    ``training_step`` runs as usual. Gradients equal one process's on the same global batch; fp16 overflows skip
    the step on every rank; clipping uses the whole model's norm.

    Args:
        pipeline_parallel, tensor_parallel, data_replicate: mesh sizes (the data-sharded size is inferred).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"zero_bubble"``, ``"zbv"``
            or ``"dualpipev"``.
        microbatches: pipeline micro-batches per loaded batch (default: ``micro_batch_size``'s, else 2 x stages).
        stages_per_rank: for the interleaved schedules (default 2; the V schedules always hold 2).
        stage_split: ``"auto"`` (the repeated blocks spread evenly) or the unit names where stages 1.. begin.
        tensor_plan: ``"auto"``, ``None`` or a dict module name -> ``"colwise"``/``"rowwise"``/``"sequence"``/style.
        global_batch_size, micro_batch_size, partial_window: as for ``AccelFSDP`` (pipeline: ``_batch.py``'s rule).
        shard_policy, reduce_dtype: as for ``AccelFSDP``. reshard_after_forward: ``None``: not under a pipeline.
        state_dict_type: ``"sharded"`` (a distributed checkpoint that resumes under another layout) or ``"full"``.
        context_parallel: only 1 (context parallel's backward has no CPU kernel; not supported yet).
        process_group_backend, timeout, start_method: as for ``AccelDDP``.

    Raises:
        ValueError/TypeError: a bad argument here; at setup (before the first step) sizes that do not fit the world,
            a split that does not fit the stages, a micro-batch count the schedule refuses.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, plugins=[AccelPrecision("bf16-mixed")],
                          strategy=AccelParallel(pipeline_parallel=2, tensor_parallel=2, schedule="interleaved_1f1b"))
    """

    registry_names = _START_METHODS

    def __init__(
        self,
        pipeline_parallel: int = 1,
        tensor_parallel: int = 1,
        data_replicate: int = 1,
        *,
        schedule: ScheduleName = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        stage_split: Literal["auto"] | Sequence[str] = "auto",
        tensor_plan: TensorPlan = "auto",
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        shard_policy: sharding.ShardPolicy = "auto",
        reshard_after_forward: bool | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        context_parallel: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn"] = "popen",
    ) -> None:
        name = type(self).__name__
        check_backend_spec(name, process_group_backend)
        _checks.check_arguments(name, locals())
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.pipeline_parallel, self.tensor_parallel, self.data_replicate = (
            pipeline_parallel,
            tensor_parallel,
            data_replicate,
        )
        self.schedule = schedule
        self.microbatches, self.stages_per_rank, self.stage_split = microbatches, stages_per_rank, stage_split
        self.tensor_plan = tensor_plan
        self.shard_policy, self.reduce_dtype = shard_policy, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.state_dict_type = state_dict_type
        self.context_parallel = context_parallel
        self._start_method = start_method
        self._one_stage = OneStageBatch(
            name, global_batch_size, micro_batch_size, partial_window, pipeline_parallel > 1
        )
        self._global_batch_size, self._micro_batch_size = global_batch_size, micro_batch_size
        self._layout: ParallelLayout | None = None
        self._mesh: DeviceMesh | None = None
        self._parts: ParallelModel | None = None
        self._pipeline: PipelineRunner | None = None
        self._comm_stats = ParallelCommStats()
        self._sync_blocked = False
        self._clip: tuple[float, Any] | None = None  # (value, algorithm) taken from the Trainer while fitting
        self._trainer: pl.Trainer | None = None
        #: The model's gradient norm before the last clipping (a device tensor; with ``gradient_clip_val`` only).
        self.last_grad_norm: Tensor | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"accel_parallel"`` (and its spawn variant); names already present are kept."""
        for name, start_method in cls.registry_names.items():
            if name not in strategy_registry:
                description = f"{cls.__name__} with start_method {start_method!r}"
                strategy_registry.register(name, cls, description=description, start_method=start_method)

    # ------------------------------------------------------------------ public state

    @property
    def layout(self) -> ParallelLayout:
        """The mesh sizes (known from ``setup_environment``)."""
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__}.layout is known once the processes have started.")
        return self._layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The 4-D mesh ``(pipeline, data_replicate, data_shard, tensor)``."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh is built when the processes have started.")
        return self._mesh

    @property
    def comm_stats(self) -> CommStats:
        """All-gathers and reduce-scatters over the data dimension (``FSDPCommStats``)."""
        return self._comm_stats

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's stages and schedules (``None`` without a pipeline dimension)."""
        return self._pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one data-parallel replica (its pipeline stages and tensor shards) load the same samples.
        return {"num_replicas": self.layout.data, "rank": self.layout.data_rank(self.global_rank)}

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """True only so that Lightning calls ``load_optimizer_state_dict`` (the resume fix); DCP loaded them."""
        return True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # The optimizers were loaded by DCP here; Lightning only checks that the key is there.
        return {"optimizer_states": [], **super().load_checkpoint(checkpoint_path, weights_only=weights_only)}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            resume_finished_epoch(trainer)  # Lightning #19617: else a finished epoch trains one batch again

    # ------------------------------------------------------------------ environment and setup

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _compat.strategy_launcher(self, self._start_method)

    @override
    def setup_environment(self) -> None:
        name = type(self).__name__
        if self._process_group_backend is not None:
            backend_for_device(name, self._process_group_backend, self.root_device)
        world = self.num_nodes * self.num_processes
        self._layout = ParallelLayout.from_world(
            name, world, self.pipeline_parallel, self.tensor_parallel, self.data_replicate
        )
        _checks.check_environment(name, self, self._layout)
        self._comm_stats.data = self._layout.data  # the FSDP groups' size, for the ring bytes
        _compat.set_model_parallel_sizes(self, world, 1)
        super().setup_environment()
        self._mesh = self._layout.build_mesh(self.root_device.type)
        rank_zero_info(f"{name}: {self._layout.describe()}.")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Split, tensor-parallelise and shard the model for this rank; then optimizers and precision as Lightning."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self._trainer = trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.accelerator.setup(trainer)
        layout, module = self.layout, self.lightning_module
        spec = SCHEDULES[self.schedule]
        _checks.check_model(type(self).__name__, self, module, layout, spec)
        if self._parts is None:  # a second fit/validate keeps the model as built
            self._parts = build_parallel_model(module, layout, self.device_mesh, self.global_rank, self.root_device,
                                               self.precision_plugin, self._build_config(spec))  # fmt: skip
            for root in [*self._parts.fsdp_roots, *self._parts.stages]:
                install_counting_comms(root, self._comm_stats)
            self._pipeline = self._make_pipeline(spec, module)
            self._comm_stats.bubble = None if self._pipeline is None else self._pipeline.meter
        self.barrier()
        if fitting:
            self._one_stage.at_setup(trainer, module, layout)
            self._take_clipping(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _build_config(self, spec: Any) -> BuildConfig:
        precision = self.precision_plugin
        param_dtype = _PARAM_DTYPES.get(precision.precision) if isinstance(precision, MixedPrecision) else None
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = self.pipeline_parallel == 1  # torchtitan's choice: stages keep parameters from F to B
        return BuildConfig(type(self).__name__, spec, self.stages_per_rank, self.stage_split, self.tensor_plan,
                           self.shard_policy, reshard, param_dtype, self.reduce_dtype)  # fmt: skip

    def _make_pipeline(self, spec: Any, module: pl.LightningModule) -> PipelineRunner | None:
        parts = self._parts
        if parts is None or not parts.stages:
            return None
        stages_total = parts.num_stages
        microbatches = self.microbatches or 2 * stages_total  # replaced by the batch plan at fit start
        return PipelineRunner(type(self).__name__, spec, parts.stages, stages_total,
                              self.device_mesh["pipeline"].get_group(), self.root_device, microbatches,
                              module.pipeline_loss, self._comm_stats)  # type: ignore[arg-type]  # fmt: skip

    def _take_clipping(self, trainer: pl.Trainer) -> None:
        """Clip by norm here, over every stage and mesh dimension: Lightning's would use one stage's shards."""
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            self._clip = (float(trainer.gradient_clip_val), trainer.gradient_clip_algorithm)
            trainer.gradient_clip_val = None

    @override
    def on_train_start(self) -> None:
        trainer, pipeline = self._trainer, self._pipeline
        assert trainer is not None
        loaded = self._one_stage.at_train_start(
            trainer, self.lightning_module, self.layout, self.root_device, bool(self.lr_scheduler_configs)
        )
        if pipeline is not None and loaded is not None:
            plan = plan_pipeline_batch(
                type(self).__name__, loaded, self.layout.data, global_batch_size=self._global_batch_size,
                microbatches=self.microbatches, micro_batch_size=self._micro_batch_size,
                num_stages=pipeline.num_stages, accumulation=trainer.accumulate_grad_batches,
            )  # fmt: skip
            pipeline.microbatches = plan.micro_batches
            _checks.check_pipeline_batch(type(self).__name__, pipeline, plan)
            rank_zero_info(f"{type(self).__name__}: {plan.describe()}.")
        super().on_train_start()

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            self._one_stage.count_micro_batch()
            return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        scale = self._loss_scale()
        with self.precision_plugin.train_step_context():
            return self._pipeline.train_step(args[0], self.lightning_module, scale)

    def _loss_scale(self) -> Tensor | None:
        """The fp16 scale as a device tensor, recorded by the scaler on every stage (only the last one scales)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler.scale(torch.ones((), device=self.root_device))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.val_step_context(), torch.no_grad():
            loss = self._pipeline.eval_step(args[0], module)
        module.log("val_loss", loss, sync_dist=True)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran every backward inside training_step: only the hooks around it are left to call.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline.restore_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if not self._sync_blocked and self._parts is not None and self._parts.fsdp_roots:
            self._comm_stats.rounds += 1  # this backward (or pipeline pass) reduce-scattered every group

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        trainer = self._trainer
        accumulation = 1 if trainer is None else trainer.accumulate_grad_batches
        closure = self._one_stage.wrap_closure(closure, optimizer, accumulation, self.lightning_module)
        try:
            return super().optimizer_step(optimizer, self._agreeing(closure, optimizer), model, **kwargs)
        finally:
            self._one_stage.window_done()

    def _agreeing(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure``, then the whole model's norm, before the plugin unscales (``_gradients.py``)."""

        def record(norm: Tensor) -> None:
            self.last_grad_norm = norm

        per_stage = self.layout.world_size // self.layout.pipeline
        max_norm = None if self._clip is None else self._clip[0]
        return _gradients.agreeing_closure(closure, optimizer, self.precision_plugin, per_stage, self.root_device,
                                           max_norm, record)  # fmt: skip

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of a window keep their gradients local (no reduce-scatter)."""
        roots = [] if self._parts is None else self._parts.fsdp_roots
        if self._sync_blocked or not roots:
            yield
            return
        for root in roots:
            root.set_requires_gradient_sync(False)
        self._sync_blocked = True
        try:
            yield
        finally:
            self._sync_blocked = False
            for root in roots:
                root.set_requires_gradient_sync(True)

    @override
    def teardown(self) -> None:
        if self._clip is not None and self._trainer is not None:
            self._trainer.gradient_clip_val = self._clip[0]
            self._clip = None
        super().teardown()
