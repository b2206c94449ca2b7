"""Issue #10, invalid configurations: the table of ``docs/reliability.md``, one parametrised row per configuration.

Fit-time rows build a real 2-process AccelDDP job (gloo ranks) and call ``trainer.fit``: each must raise on every rank
*before the first training step*, proven by a callback that counts ``on_train_batch_start`` (0) and by the weights
being unchanged. All fit-time rows run in one pair of processes (a failed fit leaves the process group usable, since
every rank raises the same error before its first collective of the step). Construction-time rows raise in the
constructor; the example's rows are rejected by ``examples/vit.py``'s argument parsing, before any process starts.

Every message must name the value received, what is allowed, and the fix: each row lists one pattern for each.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lit_accel import AccelDDP, AccelPrecision, DynamicGradScaler, EfficiencyMonitor, LossScaleMonitor, NonFiniteGuard
from lit_accel.plugins.layer_sync import AccelSyncBatchNorm
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs

WORLD_SIZE = 2
MICRO = 4  # per-device batch size of the default loader


class Row(NamedTuple):
    """One invalid configuration: the error and three patterns its message must contain."""

    error: type[BaseException]
    value: str  # the value received
    allowed: str  # what is allowed
    fix: str  # how to fix it


# ----------------------------------------------------------------------------------------------------------------
# Fit-time rows: each builds (trainer arguments, model, loader) on a rank; the fit must fail before the first step
# ----------------------------------------------------------------------------------------------------------------


class _LegacyScalingSGD(torch.optim.SGD):
    """An optimizer on torch's deprecated contract: it unscales its gradients itself inside ``step(grad_scaler=)``."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


class _ModelWith(BNModel):
    def __init__(self, optimizer_factory: Callable[[Any], torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_factory = optimizer_factory

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


class _ManualModel(BNModel):
    """Manual optimization: one ``opt.step()`` per batch, whatever the Trainer's accumulation says."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def _loader(rank: int, batch_size: int = MICRO) -> DataLoader:
    return make_loader(make_dataset(64), batch_size, rank, WORLD_SIZE)


def _config(rank: int, strategy: Any = None, model: Any = None, loader: Any = None, **trainer: Any) -> dict[str, Any]:
    return {
        "strategy": strategy if strategy is not None else AccelDDP(),
        "model": model if model is not None else BNModel(),
        "loader": loader if loader is not None else _loader(rank),
        "trainer": trainer,
    }


FIT_ROWS: dict[str, tuple[Callable[[int], dict[str, Any]], Row]] = {
    "accel_ddp-global_batch_not_divisible": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=30)),
        Row(ValueError, r"global_batch_size=30\)", r"not a multiple of 8", r"Fix: global_batch_size=24 .* or 32"),
    ),
    "accel_ddp-global_batch_below_one_micro_batch_per_device": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=4)),
        Row(ValueError, r"global_batch_size=4\)", r"smaller than one loaded batch per rank \(8\)", r"Fix: global_b"),
    ),
    "accel_ddp-global_batch_not_a_multiple_of_the_world_size": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=33)),
        Row(ValueError, r"global_batch_size=33\)", r"no loader batch_size works", r"Fix: global_batch_size=32"),
    ),
    "accel_ddp-global_batch_not_divisible_known_at_setup": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=30, micro_batch_size=MICRO)),
        Row(ValueError, r"global_batch_size=30\)", r"not a multiple of 8", r"Fix: global_batch_size=24"),
    ),
    "accel_ddp-conflicting_accumulation": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=32), accumulate_grad_batches=3),
        Row(ValueError, r"accumulate_grad_batches=3\)", r"gives accumulate_grad_batches=4", r"Fix: drop one"),
    ),
    "accel_ddp-global_batch_with_accumulation_scheduler": (
        lambda rank: _config(
            rank, AccelDDP(global_batch_size=32), callbacks=[GradientAccumulationScheduler(scheduling={0: 2})]
        ),
        Row(ValueError, r"global_batch_size=32\)", r"sets the accumulation itself", r"Fix: drop one"),
    ),
    "accel_ddp-micro_batch_size_disagrees_with_loader": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=32, micro_batch_size=8)),
        Row(ValueError, r"micro_batch_size=8\)", r"larger than the train dataloader's batch_size=4", r"Fix: micro_b"),
    ),
    "accel_ddp-micro_batch_size_unreadable": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=32), loader=_unsized_batch_loader()),
        Row(ValueError, r"global_batch_size=32\)", r"has no batch_size", r"Fix: give the DataLoader a batch_size"),
    ),
    "accel_ddp-batch_sizes_differ_between_ranks": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=48), loader=_loader(rank, 4 if rank == 0 else 8)),
        Row(ValueError, r"from 4 to 8", r"no accumulation fits all of them", r"Fix: give every rank the same"),
    ),
    "accel_ddp-global_batch_with_manual_optimization": (
        lambda rank: _config(rank, AccelDDP(global_batch_size=32), model=_ManualModel()),
        Row(ValueError, r"global_batch_size=32\)", r"manual optimization, where Lightning does not", r"Fix: use .*=8"),
    ),
    "accel_ddp-static_graph_with_trainer_accumulation": (
        lambda rank: _config(rank, AccelDDP(static_graph=True), accumulate_grad_batches=2),
        Row(ValueError, r"accumulate_grad_batches=2\)", r"cannot be combined with gradient accumulation", r"Fix"),
    ),
    "accel_ddp-static_graph_with_global_batch_accumulation": (
        lambda rank: _config(rank, AccelDDP(static_graph=True, global_batch_size=32)),
        Row(ValueError, r"static_graph=True\)", r"accumulate_grad_batches=4", r"Fix: pass static_graph=False"),
    ),
    "accel_ddp-sync_bn_group_size_not_dividing_the_world": (
        lambda rank: _config(rank, AccelDDP(sync_batchnorm=AccelSyncBatchNorm(group_size=3))),
        Row(ValueError, r"group_size=3\)\)", r"Allowed: \[1, 2\]", r"Fix: pass e.g. the devices per node"),
    ),
    "accel_ddp-sync_batchnorm_contradicts_trainer": (
        lambda rank: _config(rank, AccelDDP(sync_batchnorm=False), sync_batchnorm=True),
        Row(ValueError, r"sync_batchnorm=False\)", r"contradicts Trainer\(sync_batchnorm=True\)", r"Fix: drop one"),
    ),
    "accel_ddp-torch_sync_batchnorm_on_cpu": (
        lambda rank: _config(rank, AccelDDP(sync_batchnorm=AccelSyncBatchNorm(implementation="torch"))),
        Row(ValueError, r"implementation='torch'\)", r"only runs on CUDA/XPU/HPU", r"Use implementation='portable'"),
    ),
    "accel_ddp-nccl_on_cpu": (
        lambda rank: _config(rank, AccelDDP(process_group_backend="nccl")),
        Row(ValueError, r"process_group_backend='nccl'\)", r"needs CUDA devices", r"Fix: drop process_group_backend"),
    ),
    "accel_precision-fp16_with_lbfgs": (
        lambda rank: _config(rank, model=_ModelWith(torch.optim.LBFGS), plugins=[AccelPrecision("16-mixed")]),
        Row(TypeError, r"AccelPrecision\('16-mixed'\) cannot drive torch.optim.LBFGS", r"'bf16-mixed'", r"Fix: use"),
    ),
    "accel_precision-fp16_clipping_with_self_unscaling_optimizer": (
        lambda rank: _config(
            rank,
            model=_ModelWith(lambda params: _LegacyScalingSGD(params, lr=0.1)),
            plugins=[AccelPrecision("16-mixed")],
            gradient_clip_val=1.0,
        ),
        Row(
            ValueError, r"gradient_clip_val=1.0\) with _LegacyScalingSGD", r"fused=True", r"Fix: use a torch optimizer"
        ),
    ),
    "accel_precision-device_differs_from_trainer": (
        lambda rank: _config(rank, plugins=[AccelPrecision("16-mixed", device="cuda")]),
        Row(RuntimeError, r"device='cuda'\)", r"the Trainer runs on cpu", r"pass device=None"),
    ),
}


def _unsized_batch_loader() -> DataLoader:
    # A batch sampler without a batch_size attribute (a list of index lists), as custom bucketing samplers are.
    data = make_dataset(64)
    return DataLoader(data, batch_sampler=[list(range(i, i + MICRO)) for i in range(0, 32, MICRO)])


class _CountBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1


def _fit_rows(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    results = {}
    for name, (build, _) in FIT_ROWS.items():
        pl.seed_everything(0, verbose=False)
        config = build(rank)
        model = config["model"]
        before = params_of(model)
        counter = _CountBatches()
        trainer_kwargs = dict(config["trainer"])
        callbacks = [counter, *trainer_kwargs.pop("callbacks", [])]
        kwargs = small_trainer_kwargs(devices=world_size, max_steps=2, use_distributed_sampler=False)
        kwargs.update(trainer_kwargs)
        error: BaseException | None = None
        try:
            trainer = pl.Trainer(strategy=config["strategy"], callbacks=callbacks, **kwargs)
            trainer.fit(model, config["loader"])
        except Exception as err:
            error = err
        after = params_of(model)
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        results[name] = {
            "error": None if error is None else type(error),
            "message": "" if error is None else " ".join(str(error).split()),
            "batches_started": counter.batches,
            "weights_unchanged": unchanged,
        }
    return results


@pytest.fixture(scope="module")
def fit_results() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_fit_rows, WORLD_SIZE, init_process_group=False, timeout=240)


def _check_message(message: str, row: Row) -> None:
    for part in ("value", "allowed", "fix"):
        pattern = getattr(row, part)
        assert re.search(pattern, message), f"the message lacks {part} ({pattern!r}): {message}"


@pytest.mark.parametrize("name", list(FIT_ROWS))
def test_fit_time_configuration_raises_before_the_first_step(fit_results, name):
    row = FIT_ROWS[name][1]
    for rank, results in enumerate(fit_results):
        result = results[name]
        assert result["error"] is row.error, (rank, result)
        assert result["batches_started"] == 0, (rank, result)
        assert result["weights_unchanged"], (rank, result)
        _check_message(result["message"], row)


# ----------------------------------------------------------------------------------------------------------------
# Construction-time rows
# ----------------------------------------------------------------------------------------------------------------

CONSTRUCTION_ROWS: dict[str, tuple[Callable[[], Any], Row]] = {
    "accel_ddp-unknown_comm_hook": (
        lambda: AccelDDP(comm_hook="fp8"),
        Row(ValueError, r"comm_hook='fp8'\)", r"expected one of 'fp16', 'bf16', 'powersgd'", r"Fix: pass e.g."),
    ),
    "accel_ddp-model_averaging_without_post_local_sgd": (
        lambda: AccelDDP(comm_hook="bf16", model_averaging_period=2),
        Row(ValueError, r"model_averaging_period=2\)", r"only applies to post-local SGD", r"Fix: pass comm_state="),
    ),
    "accel_ddp-non_positive_global_batch": (
        lambda: AccelDDP(global_batch_size=0),
        Row(ValueError, r"global_batch_size=0\)", r"expected an int >= 1 or None", r"Fix: pass e.g."),
    ),
    "accel_ddp-both_spellings_of_one_argument": (
        lambda: AccelDDP(ddp_comm_hook=lambda state, bucket: None, comm_hook="bf16"),
        Row(
            ValueError,
            r"ddp_comm_hook=\.\.\., comm_hook=\.\.\.\)",
            r"two values for the same argument",
            r"Fix: pass one",
        ),
    ),
    "accel_precision-unknown_precision": (
        lambda: AccelPrecision("fp8"),  # type: ignore[arg-type]
        Row(
            ValueError,
            r"precision='fp8'\)",
            r"'16-mixed', 'bf16-mixed' or 'fp8-mixed'.*Did you mean 'fp8-mixed'\?",
            r"Fix: pass precision='fp8-mixed'",
        ),
    ),
    "accel_precision-full_precision": (
        lambda: AccelPrecision("32-true"),  # type: ignore[arg-type]
        Row(ValueError, r"precision='32-true'\)", r"not mixed precision", r"Fix: drop the plugin.*NonFiniteGuard\(\)"),
    ),
    "nonfinite_guard-unknown_action": (
        lambda: NonFiniteGuard(action="warn"),  # type: ignore[arg-type]
        Row(ValueError, r"NonFiniteGuard\(action='warn'\)", r"'raise', 'skip'", r"Fix: pass action='raise'"),
    ),
    "dynamic_grad_scaler-growth_factor_not_above_one": (
        lambda: DynamicGradScaler(growth_factor=1.0),
        Row(ValueError, r"growth_factor=1.0\)", r"must be > 1", r"Fix: pass growth_factor=2.0.*dynamic=False"),
    ),
    "dynamic_grad_scaler-min_scale_above_init_scale": (
        lambda: DynamicGradScaler(min_scale=2.0**20),
        Row(ValueError, r"min_scale=1048576.0, init_scale=65536.0\)", r"min_scale must be <= init_scale", r"Fix: pass"),
    ),
    "dynamic_grad_scaler-zero_hysteresis": (
        lambda: DynamicGradScaler(hysteresis=0),
        Row(ValueError, r"hysteresis=0\)", r"expected an int >= 1", r"Fix: pass e.g. hysteresis=2"),
    ),
    "accel_precision-scaler_with_bf16": (
        lambda: AccelPrecision("bf16-mixed", scaler=DynamicGradScaler()),
        Row(ValueError, r"'bf16-mixed', scaler=DynamicGradScaler\(...\)\)", r"only '16-mixed' scales", r"Fix: drop"),
    ),
    "loss_scale_monitor-negative_logging_interval": (
        lambda: LossScaleMonitor(logging_interval=-1),
        Row(ValueError, r"logging_interval=-1\)", r"expected an int >= 1", r"pass e.g. logging_interval=50"),
    ),
    "loss_scale_monitor-skip_rate_threshold_above_one": (
        lambda: LossScaleMonitor(skip_rate_threshold=1.5),
        Row(ValueError, r"skip_rate_threshold=1.5\)", r"fraction in \(0, 1\]", r"such as 0.05.*or None"),
    ),
    "efficiency_monitor-mfu_peak_not_positive": (
        lambda: EfficiencyMonitor(peak_flops=0),
        Row(ValueError, r"peak_flops=0\)", r"finite number > 0 or None", r"omit it to use the datasheet table"),
    ),
    "efficiency_monitor-negative_warmup": (
        lambda: EfficiencyMonitor(warmup_steps=-1),
        Row(ValueError, r"warmup_steps=-1\)", r"expected an int >= 0", r"Fix: pass e\.g\. warmup_steps="),
    ),
    "accel_sync_batchnorm-non_positive_group_size": (
        lambda: AccelSyncBatchNorm(group_size=0),
        Row(ValueError, r"group_size=0\)", r"an int >= 1 or None", r"Fix: pass e.g. group_size=8"),
    ),
}


@pytest.mark.parametrize("name", list(CONSTRUCTION_ROWS))
def test_construction_time_configuration_raises(name):
    build, row = CONSTRUCTION_ROWS[name]
    with pytest.raises(row.error) as info:
        build()
    _check_message(" ".join(str(info.value).split()), row)


# ----------------------------------------------------------------------------------------------------------------
# The example's rows: examples/vit.py checks its flags before any process starts (its own tests cover the rest)
# ----------------------------------------------------------------------------------------------------------------

EXAMPLE_ROWS: dict[str, tuple[list[str], Row]] = {
    "example-global_batch_not_divisible": (
        ["--accelerator", "cpu", "--devices", "2", "--batch-size", "4", "--global-batch-size", "30"],
        Row(
            Exception,
            r"--global-batch-size 30",
            r"not divisible by --batch-size 4 x 2 devices",
            r"Fix: --global-batch-size 24 or 32, or --batch-size 3 or 5",
        ),
    ),
    "example-accumulate_contradicts_global_batch": (
        ["--accelerator", "cpu", "--devices", "2", "--batch-size", "4", "--global-batch-size", "32", "--accumulate=3"],
        Row(Exception, r"--accumulate 3", r"contradicts --global-batch-size 32", r"give only one of them"),
    ),
    "example-non_positive_batch_size": (
        ["--accelerator", "cpu", "--batch-size", "0"],
        Row(Exception, r"got 0", r"--batch-size must be a positive integer", r"positive integer"),
    ),
}


@pytest.fixture(scope="module")
def vit_example() -> Any:
    """``examples/vit.py`` loaded from its file (its helper ``_vit_data`` sits next to it)."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    try:
        spec = importlib.util.spec_from_file_location("vit_example_invalid_rows", examples / "vit.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(examples))


@pytest.mark.parametrize("name", list(EXAMPLE_ROWS))
def test_example_rejects_the_configuration_before_training(vit_example, name):
    argv, row = EXAMPLE_ROWS[name]
    with pytest.raises(vit_example.UsageError) as info:
        vit_example.parse_args(argv)
    _check_message(str(info.value), row)


def test_the_table_has_at_least_fifteen_fit_time_rows_and_covers_every_component():
    assert len(FIT_ROWS) >= 15
    components = {name.split("-")[0] for name in [*FIT_ROWS, *CONSTRUCTION_ROWS, *EXAMPLE_ROWS]}
    assert {"accel_ddp", "accel_precision", "loss_scale_monitor", "efficiency_monitor", "example"} <= components
