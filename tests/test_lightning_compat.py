"""Drop-in: code written for Lightning's ``DDPStrategy`` and ``MixedPrecision`` keeps working with lit_accel's.

Each lit_accel class is constructed the ways user code and Lightning's own tests construct Lightning's (positional,
keyword, registry name, LightningCLI flags and YAML), and the shared public surface is checked against Lightning's.
Distributed behaviour runs on real gloo processes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

from lit_accel import AccelDDP, AccelPrecision, AccelSyncBatchNorm, DynamicGradScaler
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs

# ---------------------------------------------------------------------------------------------- AccelPrecision


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_accel_precision_has_mixed_precisions_public_surface(precision):
    ours = AccelPrecision(precision, "cpu")
    lightning = MixedPrecision(precision, "cpu")
    assert type(ours) is AccelPrecision and isinstance(ours, MixedPrecision) and ours.precision == lightning.precision
    # Lightning's ThroughputMonitor picks its peak from this: the same dtype as Lightning's own plugin.
    assert _plugin_to_compute_dtype(ours) == _plugin_to_compute_dtype(lightning)
    assert ours.device == "cpu" and isinstance(ours.device, str)
    ours_ctx, theirs_ctx = ours.autocast_context_manager(), lightning.autocast_context_manager()
    assert (ours_ctx.device, ours_ctx.fast_dtype) == (theirs_ctx.device, theirs_ctx.fast_dtype)
    assert (ours.scaler is None) is (lightning.scaler is None)
    # Full precision is Lightning's Precision (fp32 peak); a MixedPrecision subclass would claim fp16 there.
    assert _plugin_to_compute_dtype(Precision()) == torch.float32
    with pytest.raises(ValueError, match="drop the plugin"):
        AccelPrecision("32-true")


def _fit_with(plugin: AccelPrecision, steps: int, overflow_at: int | None = None) -> pl.Trainer:
    class Model(BNModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.trainer.global_step == overflow_at else loss

    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=steps, plugins=[plugin]))
    trainer.fit(Model(batchnorm=False), make_loader(make_dataset(32), 4))
    return trainer


def test_a_scaler_given_or_assigned_is_the_object_used():
    # As in Lightning: a torch GradScaler (torch's rule, its own state) drives the fit, whether passed or assigned.
    given = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=3)
    passed = AccelPrecision("16-mixed", "cpu", given)
    assert passed.scaler is given
    _fit_with(passed, 5, overflow_at=1)
    assert passed.scaler is given and given.get_scale() == 64.0  # halved at step 1, grown after 3 clean steps
    assert given._get_growth_tracker() == 0 and passed.step_was_skipped() is False
    assigned = AccelPrecision("16-mixed")
    assigned.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**5)  # before fit
    _fit_with(assigned, 3)
    assert type(assigned.scaler) is torch.amp.GradScaler and assigned.scaler._get_growth_tracker() == 3
    injected = DynamicGradScaler(init_scale=2.0**4, hysteresis=2)
    plugin = AccelPrecision("16-mixed", scaler=injected)
    _fit_with(plugin, 3)
    assert plugin.scaler is injected and injected.device == torch.device("cpu")  # never replaced
    assert injected.scaler_stats().growth_tracker.item() == 3  # it drove the fit: three clean steps counted


def _fit_fp16(plugin: Precision, tmp_path: Any, steps: int, ckpt: Any = None, overflow_at: int | None = None) -> Any:
    class Model(BNModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.trainer.global_step == overflow_at else loss

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=steps, plugins=[plugin], default_root_dir=tmp_path))
    trainer.fit(Model(batchnorm=False), make_loader(make_dataset(64), 4), ckpt_path=ckpt)
    return trainer


def test_a_checkpoint_round_trips_accel_to_mixed_to_accel_with_the_loss_scale(tmp_path):
    first = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=1000))
    _fit_fp16(first, tmp_path, 3, overflow_at=1).save_checkpoint(tmp_path / "accel.ckpt")
    assert first.loss_scale == 128.0  # one overflow halved it
    mixed = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000))
    _fit_fp16(mixed, tmp_path, 5, ckpt=tmp_path / "accel.ckpt", overflow_at=3).save_checkpoint(tmp_path / "mixed.ckpt")
    assert mixed.scaler.get_scale() == 64.0  # resumed at 128, halved again by the overflow at step 3
    last = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=1000))
    _fit_fp16(last, tmp_path, 6, ckpt=tmp_path / "mixed.ckpt")
    assert last.loss_scale == 64.0


# ---------------------------------------------------------------------------------------------- AccelDDP


def _hook(state: Any, bucket: Any) -> Any:
    return default_hooks.allreduce_hook(state, bucket)


def test_accel_ddp_takes_ddp_strategys_positional_and_keyword_arguments():
    state, timeout = object(), timedelta(seconds=77)
    ours = AccelDDP(None, None, None, None, None, state, _hook, None, None, "gloo", timeout, "spawn")
    theirs = DDPStrategy(None, None, None, None, None, state, _hook, None, None, "gloo", timeout, "spawn")
    assert (ours._comm_hook, ours._comm_state) == (_hook, state)
    for attribute in ("_process_group_backend", "_timeout", "_start_method"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    by_name = AccelDDP(ddp_comm_hook=default_hooks.fp16_compress_hook, find_unused_parameters=True)
    assert by_name._comm_hook is default_hooks.fp16_compress_hook and by_name._ddp_kwargs["find_unused_parameters"]
    assert isinstance(StrategyRegistry.get("accel_ddp"), AccelDDP)
    assert StrategyRegistry.get("accel_ddp_spawn")._start_method == "spawn"


def test_a_device_list_spec_resolves_to_the_backend_of_the_ranks_device():
    from lit_accel.strategies.parts._backend import backend_for_device

    assert backend_for_device("AccelDDP", "cpu:gloo,cuda:nccl", torch.device("cpu")) == "gloo"
    assert backend_for_device("AccelDDP", "CPU:GLOO,CUDA:NCCL", torch.device("cuda", 1)) == "nccl"
    assert backend_for_device("AccelDDP", "Gloo", torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("spec", ["NCCL", "cuda:nccl", "nosuch"])
def test_backends_that_cannot_carry_cpu_tensors_are_refused_before_the_group_starts(spec):
    trainer = pl.Trainer(**small_trainer_kwargs(strategy=AccelDDP(process_group_backend=spec)))
    with pytest.raises(ValueError, match=rf"process_group_backend='{spec}'\).*Fix"):
        trainer.fit(BNModel(), make_loader(make_dataset(16), 4))


def _register_gloo_alias() -> None:
    # A backend registered after the strategy was built, as plugin packages do: a gloo group under another name.
    def create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("litaccelgloo", create, devices=["cpu"])


def _fit_ddp(rank: int, world_size: int, strategy: AccelDDP) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=False)
    kwargs = small_trainer_kwargs(devices=world_size, max_steps=4, use_distributed_sampler=False, strategy=strategy)
    pl.Trainer(**kwargs).fit(model, make_loader(make_dataset(64), 4, rank, world_size))
    backend = str(dist.get_backend())
    dist.destroy_process_group()  # the next fit starts a group with its own backend
    return {"backend": backend, "params": params_of(model), "calls": strategy.comm_stats.calls}


def _ddp_runs(rank: int, world_size: int) -> dict[str, Any]:
    runs = {spec: _fit_ddp(rank, world_size, AccelDDP(process_group_backend=spec)) for spec in _SPECS}
    registered_later = AccelDDP(process_group_backend="litaccelgloo")
    _register_gloo_alias()
    runs["litaccelgloo"] = _fit_ddp(rank, world_size, registered_later)
    runs["ddp_comm_hook"] = _fit_ddp(rank, world_size, AccelDDP(ddp_comm_hook=_hook))
    wrapped = AccelDDP(ddp_comm_hook=_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    runs["ddp_comm_wrapper"] = _fit_ddp(rank, world_size, wrapped)
    return runs


# "cpu:gloo,cuda:nccl" is checked without a group below: torch's init itself needs a GPU for its nccl part.
_SPECS = ("cpu:gloo", "GLOO")


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict[str, Any]]:
    return run_distributed(_ddp_runs, 2, init_process_group=False, timeout=180)


def test_every_backend_spelling_torch_accepts_trains(ddp_runs):
    reference = ddp_runs[0]["cpu:gloo"]["params"]
    for runs in ddp_runs:
        for spec in (*_SPECS, "litaccelgloo"):
            assert runs[spec]["backend"] == spec.lower(), (spec, runs[spec]["backend"])
            assert all(torch.equal(runs[spec]["params"][k], reference[k]) for k in reference), spec


def test_lightning_comm_arguments_register_hooks_on_gloo(ddp_runs):
    for runs in ddp_runs:
        assert runs["ddp_comm_hook"]["calls"] == 4 and runs["ddp_comm_wrapper"]["calls"] == 4  # one bucket a step
        for key, value in runs["ddp_comm_hook"]["params"].items():
            assert torch.allclose(value, runs["cpu:gloo"]["params"][key])


def _post_local_sgd(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    subgroup, _ = dist.new_subgroups(group_size=1)  # local SGD: after the warm-up each rank steps alone...
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2)
    strategy = AccelDDP(ddp_comm_state=state, ddp_comm_hook=post_localSGD_hook.post_localSGD_hook,
                        model_averaging_period=3)  # fmt: skip
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=False)
    states = []

    class Record(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            states.append(params_of(model))

    kwargs = small_trainer_kwargs(devices=world_size, max_steps=6, use_distributed_sampler=False, strategy=strategy)
    pl.Trainer(callbacks=[Record()], **kwargs).fit(model, make_loader(make_dataset(64), 4, rank, world_size))
    return states  # ...and every 3rd step the models are averaged (DDPStrategy's PeriodicModelAverager)


def test_post_local_sgd_runs_on_gloo_with_periodic_model_averaging():
    ranks = run_distributed(_post_local_sgd, 2, timeout=120)
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(*ranks)]
    # Steps 0-1 all-reduce (warm-up); steps 2-5 are local, and step 5 (the 6th, period 3 after warm-up) averages.
    assert same[:2] == [True, True] and not all(same[2:5]) and same[5]


# ---------------------------------------------------------------------------------------------- LightningCLI


def _cli(args: list[str]) -> pl.Trainer:
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None, args=args)
    return cli.trainer


def test_lightning_cli_configures_the_strategy_and_plugin_from_flags_and_yaml(tmp_path):
    flags = _cli(["--trainer.accelerator=cpu", "--trainer.strategy=lit_accel.AccelDDP",
                  "--trainer.strategy.global_batch_size=64", "--trainer.strategy.comm_hook=bf16"])  # fmt: skip
    assert isinstance(flags.strategy, AccelDDP) and flags.strategy.global_batch_size == 64
    assert flags.strategy._ddp_kwargs == {"gradient_as_bucket_view": True}  # CLI-passed DDP defaults are dropped
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  strategy:\n    class_path: lit_accel.AccelDDP\n    init_args:\n"
        "      sync_batchnorm:\n        class_path: lit_accel.AccelSyncBatchNorm\n        init_args: {group_size: 2}\n"
        "  plugins:\n    - class_path: lit_accel.AccelPrecision\n      init_args:\n        precision: 16-mixed\n"
        "        scaler: {class_path: lit_accel.DynamicGradScaler, init_args: {hysteresis: 2, init_scale: 1024}}\n"
    )
    yaml = _cli(["--config", str(config)])
    assert (
        isinstance(yaml.strategy.parts.batchnorm_sync.plugin, AccelSyncBatchNorm)
        and yaml.strategy.sync_bn_group_size == 2
    )
    plugin = yaml.precision_plugin
    assert isinstance(plugin, AccelPrecision) and isinstance(plugin, MixedPrecision)
    assert plugin.scaler.hysteresis == 2 and plugin.loss_scale == 1024.0
    with pytest.raises(SystemExit):  # a misspelled argument fails before any process starts
        _cli(["--trainer.strategy=lit_accel.AccelDDP", "--trainer.strategy.global_batch_sise=64"])
