"""AccelParallel: pipeline, tensor and sharded data parallel (3D) in the Lightning Trainer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_accel.layout import blocks as _blocks
from lit_accel.layout.mesh import ParallelLayout
from lit_accel.layout.plan import ParallelPlan
from lit_accel.layout.schedules import ScheduleName
from lit_accel.layout.tensor_check import PlanCheck
from lit_accel.layout.tensor_plan import TensorPlan
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from lit_accel.strategies.parts._backend import check_backend_spec, resolve_backend
from lit_accel.strategies.parts.accel_parts import AccelParts, register_names, serves_parts_attributes
from lit_accel.strategies.sharded import _checks, _gradients
from lit_accel.strategies.sharded import _fsdp_sharding as sharding
from lit_accel.strategies.sharded._build import BuildConfig, ParallelModel, build_parallel_model, sync_layers
from lit_accel.strategies.sharded._fsdp_comm import GradientSync, gathered_attempts, install_counting_comms
from lit_accel.strategies.sharded._pipeline import PipelineRunner
from lit_accel.strategies.sharded._pipeline_batch import check_no_accumulation, fit_pipeline
from lit_accel.strategies.sharded._stage import ParallelCommStats
from lit_accel.utilities import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch import Tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lit_accel.protocols import CommStats, StagePlacement

__all__ = ["AccelParallel"]

_START_METHODS = {"accel_parallel": "popen", "accel_parallel_spawn": "spawn"}


@serves_parts_attributes
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
        global_batch_size, micro_batch_size, partial_window, sync_batchnorm, hang_timeout: as for ``AccelFSDP``
            (SyncBatchNorm over each data dimension: the ranks of one pipeline and tensor coordinate; under a
            pipeline an int ``micro_batch_size`` is the pipeline's micro-batch, and there is no accumulation).
        compile: as for ``AccelFSDP``; each block is compiled after tensor parallelism, before FSDP, on every stage.
        shard_policy, reduce_dtype, activation_checkpointing, cpu_offload: as for ``AccelFSDP``, on every layout and
            stage. reshard_after_forward: ``None``: not under a pipeline.
        state_dict_type: ``"sharded"`` (a distributed checkpoint that resumes under another layout) or ``"full"``.
        context_parallel: only 1 (context parallel's backward has no CPU kernel; not supported yet).
        process_group_backend, timeout, start_method: as for ``AccelDDP``.

    Raises:
        ValueError/TypeError: a bad argument here; at setup (before ``configure_optimizers``) sizes that do not fit
            the world, a batch plan that cannot be made, a split that does not fit the stages, a micro-batch count the
            schedule refuses.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, plugins=[AccelPrecision("bf16-mixed")],
                          strategy=AccelParallel(pipeline_parallel=2, tensor_parallel=2, schedule="interleaved_1f1b"))
    """

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
        micro_batch_size: int | Literal["auto"] | None = None,
        partial_window: Literal["mean", "lightning"] = "mean",
        sync_batchnorm: bool | AccelSyncBatchNorm = True,
        shard_policy: _blocks.ShardPolicy = "auto",
        reshard_after_forward: bool | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        activation_checkpointing: bool | _blocks.ShardPolicy = False,
        cpu_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        context_parallel: int = 1,
        hang_timeout: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        name = type(self).__name__
        check_backend_spec(name, process_group_backend)
        # Checked by name as they arrive; the plan is sized for the world in setup_environment.
        self._plan = ParallelPlan.build(
            name, None, pipeline_parallel=pipeline_parallel, tensor_parallel=tensor_parallel,
            data_replicate=data_replicate, context_parallel=context_parallel, schedule=schedule,
            stages_per_rank=stages_per_rank, microbatches=microbatches, stage_split=stage_split,
            tensor_plan=tensor_plan, shard_policy=shard_policy, reshard_after_forward=reshard_after_forward,
            reduce_dtype=reduce_dtype, activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
        )  # fmt: skip
        _checks.check_arguments(name, self._plan, micro_batch_size=micro_batch_size, state_dict_type=state_dict_type,
                                partial_window=partial_window, start_method=start_method)  # fmt: skip
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        #: The strategy-independent parts (batch plan, exact window, watchdog, resume fixes, compile), called below.
        self.parts = AccelParts(name, global_batch_size, micro_batch_size, partial_window, sync_batchnorm,
                                hang_timeout=hang_timeout, compile=compile)  # fmt: skip
        self.state_dict_type = state_dict_type
        self._start_method = start_method
        self._mesh: DeviceMesh | None = None
        self._built: ParallelModel | None = None
        self._plan_check: PlanCheck | None = None  # until the first optimizer step of the first fit
        self._pipeline: PipelineRunner | None = None
        self._comm_stats = ParallelCommStats()
        self._sync = GradientSync()  # FSDP's gradient reduction, off for a window's non-final backward passes
        self._clip: tuple[float, Any] | None = None  # (value, algorithm) taken from the Trainer while fitting
        #: The model's gradient norm before the last clipping (a device tensor; with ``gradient_clip_val`` only).
        self.last_grad_norm: Tensor | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, _START_METHODS, strategy_registry)

    @property
    def plan(self) -> ParallelPlan:
        """The layout, schedule, pipeline and sharding choices (the smallest world's until ``setup_environment``)."""
        return self._plan

    @property
    def layout(self) -> ParallelLayout:
        """The mesh sizes (``plan.layout``)."""
        return self.plan.layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The 4-D mesh ``(pipeline, data_replicate, data_shard, tensor)``."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh is built when the processes start. Fix: use setup.")
        return self._mesh

    @property
    def comm_stats(self) -> CommStats:
        """All-gathers and reduce-scatters over the data dimension (``FSDPCommStats``)."""
        return self._comm_stats

    @property
    def sharded_modules(self) -> list[torch.nn.Module]:
        """The modules ``fully_shard`` was applied to by this strategy (none when ``configure_model`` sharded)."""
        return [] if self._built is None else self._built.sharded

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's stages and schedules (``None`` without a pipeline dimension)."""
        return self._pipeline

    @property
    def pipeline_stages(self) -> StagePlacement | None:
        """Every pipeline rank's stages and this rank's coordinate (``PipelineStages``); ``None`` without a pipeline."""
        plan = self._plan
        if plan.layout.pipeline == 1:
            return None
        ran = 1 if self._pipeline is None else self._pipeline.last_microbatches
        return plan.placement(self.global_rank, ran)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one data-parallel replica (its pipeline stages and tensor shards) load the same samples.
        return {"num_replicas": self.layout.data, "rank": self.layout.data_rank(self.global_rank)}

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """True only so that Lightning calls ``load_optimizer_state_dict`` (the resume fixes); DCP loaded them."""
        return True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # The optimizers were loaded by DCP here; Lightning only checks that the key is there.
        return {"optimizer_states": [], **super().load_checkpoint(checkpoint_path, weights_only=weights_only)}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.parts.loops_restored()  # the first strategy hook after Lightning restored the loops

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _compat.strategy_launcher(self, self._start_method)

    @override
    def setup_environment(self) -> None:
        name = type(self).__name__
        self._process_group_backend = resolve_backend(name, self._process_group_backend, self.root_device,
                                                      cpu_collectives=self._plan.cpu_offload)  # fmt: skip
        world, precision = self.num_nodes * self.num_processes, self.precision_plugin
        self._plan = self._plan.for_world(name, world, param_dtype=sharding.parameter_dtype(precision))
        layout = self._plan.layout
        _checks.check_environment(name, self._plan, self.root_device)
        self._comm_stats.data = layout.data  # the FSDP groups' size, for the ring bytes
        _compat.set_model_parallel_sizes(self, world, 1)
        super().setup_environment()
        self._mesh = layout.build_mesh(self.root_device.type)
        rank_zero_info(f"{name}: {self._plan.describe()}.")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The batch plan (before ``configure_optimizers``); this rank's share of the model; optimizers, precision."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        name, layout, module = type(self).__name__, self.layout, self.lightning_module
        _checks.check_model(name, self, module, layout)
        # Agreed over the world (data_parallel_size is the mesh's data dimension): a replica's stages and shards load
        # the same batches too, and the world needs no flattened sub-mesh group.
        split = self.plan.pipeline_split(self.parts.planner.micro_batch_size)
        plan = self.parts.setup(self, trainer, data_parallel_size=layout.data, **split)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and layout.pipeline > 1:
            check_no_accumulation(name, trainer, plan)
        self.accelerator.setup(trainer)
        if self._built is None:  # a second fit/validate keeps the model as built (its layer sync put back)
            self._build(module)
        else:
            sync_layers(module, self.plan, _compat.get_layer_sync(self))
        self.barrier()
        if fitting:
            fit_pipeline(name, self._pipeline, self.parts.batch_plan)
            self._clip = _gradients.take_clipping(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _build(self, module: pl.LightningModule) -> None:
        name, compiling = type(self).__name__, self.parts.compilation is not None
        config = BuildConfig(name, self.plan, functools.partial(self.parts.compile_blocks, name) if compiling else None,
                             _compat.get_layer_sync(self))  # fmt: skip
        built = build_parallel_model(module, self.device_mesh, self.global_rank, self.root_device,
                                     self.precision_plugin, config)  # fmt: skip
        for root in [*built.fsdp_roots, *built.stages]:
            install_counting_comms(root, self._comm_stats)
        self._built, self._sync.roots, self._plan_check = built, built.fsdp_roots, built.plan_check
        if built.stages:
            num_stages = self.plan.num_stages
            self._pipeline = PipelineRunner(name, self.plan.schedule, built.stages, num_stages,
                                            self.device_mesh["pipeline"].get_group(), self.root_device,
                                            self.plan.microbatches or 2 * num_stages, module.pipeline_loss,
                                            self._comm_stats)  # type: ignore[arg-type]  # fmt: skip
            self._comm_stats.bubble = self._pipeline.meter

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._plan_check is not None:
            self._plan_check.arm()  # after the sanity check: the first training forward is compared

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        check = self._plan_check
        with check.eager(self.parts.compilation is not None) if check is not None else nullcontext():
            return self.parts.training_step(self, self._training_step, *args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """A loaded batch (or micro-batch) through Lightning's ``training_step``, or all its micro-batches' pipeline."""
        if self._pipeline is None:
            return self._root_step(self.precision_plugin.train_step_context, "training_step", args, kwargs)
        assert self.lightning_module is not None
        scale = _gradients.loss_scale(self.precision_plugin, self.root_device)
        with self.precision_plugin.train_step_context():
            return self._pipeline.train_step(args[0], self.lightning_module, scale)

    def _root_step(self, context: Callable[[], Any], name: str, args: tuple, kwargs: dict) -> Any:
        """A step through the root's ``__call__``, whose FSDP hooks gather its own parameters (a stem, a head)."""
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        with context():
            if isinstance(module, FSDPModule):  # the wrapper is the module itself: redirect through its hooks
                return self._forward_redirection(module, module, name, *args, **kwargs)
            return getattr(module, name)(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._root_step(self.precision_plugin.test_step_context, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._root_step(self.precision_plugin.predict_step_context, "predict_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._pipeline is None:
            return self._root_step(self.precision_plugin.val_step_context, "validation_step", args, kwargs)
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context():
            return self._pipeline.validation_step(args[0], self.lightning_module)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return self.parts.backward(super().backward, closure_loss, optimizer, *args, **kwargs)
        return self._pipeline.backward_hooks(self, closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self._sync.roots and not self._sync.blocked:
            self._comm_stats.rounds += 1  # this backward (or pipeline pass) reduce-scattered every group

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # AccelParts' closure ends the window (a short one made exact); inside it, the agreement over the mesh.
        if self._plan_check is not None:  # the first step: after its forward and backward, before any update
            closure = self._plan_check.verdict_after(closure)
        return self.parts.optimizer_step(self._agreeing_step, optimizer, closure, model, **kwargs)

    def _agreeing_step(self, optimizer: Optimizer, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's step with ``closure`` followed by the whole model's norm, before the plugin unscales."""

        def record(norm: Tensor) -> None:
            self.last_grad_norm = norm

        per_stage = self.layout.world_size // self.layout.pipeline
        max_norm = None if self._clip is None else self._clip[0]
        agreeing = _gradients.agreeing_closure(closure, optimizer, self.precision_plugin, per_stage, self.root_device,
                                               max_norm, record)  # fmt: skip
        return super().optimizer_step(optimizer, agreeing, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of a window keep their gradients local (no reduce-scatter)."""
        with self._sync.switched(False):
            yield

    def gradient_sync(self) -> AbstractContextManager[None]:
        """The backward run inside reduce-scatters, even within Lightning's accumulation window (micro-batching)."""
        return self._sync.switched(True)

    def forward_collective(self) -> str | None:
        """What makes a collective in the model's forward: FSDP's all-gathers (and TP's), when sharded."""
        return "FSDP's all-gathers" if self._sync.roots else None

    def without_collectives(self) -> AbstractContextManager[Callable[[], None]] | None:
        """``"auto"``'s attempts with every parameter gathered (as AccelFSDP's), where only FSDP makes collectives."""
        built, layout = self._built, self.layout
        other = layout.tensor > 1 or layout.pipeline > 1 or self.parts.forward_collective(self) is not None
        sharded = [] if built is None or other else built.sharded
        return gathered_attempts(sharded, self._sync, self.plan.reshard_after_forward)

    @override
    def teardown(self) -> None:
        self.parts.teardown()
        trainer, layer_sync = self.parts.trainer, _compat.get_layer_sync(self)
        if self._clip is not None and trainer is not None:
            trainer.gradient_clip_val = self._clip[0]
            self._clip = None
        if layer_sync is not None and self.model is not None:
            self.model = layer_sync.revert(self.model)  # the user's own layer classes back after the run
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.parts.explain_failure(self, exception)
