"""AccelPrecision in real (CPU) Trainer runs: fp16 loss scaling, skips, schedulers, clipping, resume, DDP."""

from __future__ import annotations

import ast
import copy
import inspect
import pickle
import re
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lit_accel import AccelPrecision, DynamicGradScaler, NonFiniteGuard
from lit_accel.protocols import ScalerStatsProvider, SkippedStepRecord
from lit_accel.utilities._workarounds import SkipAwareScheduler
from tests.helpers import BNModel, make_dataset, make_loader, params_of, run_distributed, small_trainer_kwargs

INF = float("inf")


class Model(BNModel):
    """The shared tiny regression model (no BatchNorm: its running stats change even on skipped steps).

    ``bad_steps`` multiplies the loss by ``bad_value`` at those ``trainer.global_step`` values (inf: overflow);
    ``scheduler="step"`` adds a StepLR(step_size=1, gamma=0.5) stepping every optimizer step.
    """

    def __init__(self, bad_steps=(), bad_value=INF, loss_factor=1.0, scheduler=None, optimizer="adamw", **kwargs):
        super().__init__(batchnorm=False, optimizer=optimizer, **kwargs)
        self.bad_steps = set(bad_steps)
        self.bad_value = bad_value
        self.loss_factor = loss_factor
        self.scheduler = scheduler
        self.training_steps = 0

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        loss = super().training_step(batch, batch_idx) * self.loss_factor
        if self.bad_steps == {"all"} or self.trainer.global_step in self.bad_steps:
            loss = loss * self.bad_value
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=self.lr)
        opt = super().configure_optimizers()
        if self.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.scheduler}}


class Recorder(pl.Callback):
    """After every optimizer step: weights, optimizer state, LR and the scaler's (or the NonFiniteGuard's) counters."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        stats = scaler.scaler_stats() if isinstance(scaler, DynamicGradScaler) else None
        guard = next((cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGuard)), None)
        self.rows.append(
            dict(
                step=trainer.global_step,
                params={k: v.detach().clone() for k, v in pl_module.named_parameters()},
                opt_state=copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
                lr=trainer.optimizers[0].param_groups[0]["lr"],
                scale=stats.scale.item() if stats else None,
                skipped=stats.skipped_steps.item() if stats else (guard.skipped_steps if guard else None),
                streak=stats.overflow_streak.item() if stats else None,
            )
        )


def _fit(model, plugin, steps, recorder=None, loader_n=64, batch=8, **kwargs):
    callbacks = [*kwargs.pop("callbacks", []), *([recorder] if recorder is not None else [])]
    plugins = [plugin] if plugin is not None else []
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=steps, plugins=plugins, callbacks=callbacks, **kwargs))
    trainer.fit(model, make_loader(make_dataset(loader_n), batch))
    return trainer


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        (dict(precision="fp16-mixed"), "'fp16-mixed'"),
        (dict(precision="32-true"), "'32-true'"),
        (dict(on_min_scale="ignore"), "'ignore'"),
        (dict(device="mps"), "'mps'"),
        (dict(min_scale_check_interval=0), "min_scale_check_interval=0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, value):
    kwargs = {"precision": "16-mixed", **kwargs}
    with pytest.raises(ValueError, match=r"AccelPrecision\(.*" + re.escape(value)):
        AccelPrecision(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        (dict(backoff_factor=0.0), "backoff_factor=0.0"),
        (dict(backoff_factor=1.0), "backoff_factor=1.0"),
        (dict(backoff_factor=-0.5), "backoff_factor=-0.5"),
        (dict(growth_factor=1.0), "growth_factor=1.0"),
        (dict(growth_factor=0.5), "growth_factor=0.5"),
        (dict(init_scale=0.0), "init_scale=0.0"),
        (dict(init_scale=-1.0), "init_scale=-1.0"),
        (dict(min_scale=8.0, init_scale=4.0), "min_scale=8.0"),
        (dict(max_scale=2.0, init_scale=4.0), "max_scale=2.0"),
        (dict(hysteresis=0), "hysteresis=0"),
        (dict(growth_interval=0), "growth_interval=0"),
    ],
)
def test_bad_scaler_settings_raise_value_error_naming_the_value(kwargs, value):
    with pytest.raises(ValueError, match=r"DynamicGradScaler\(.*" + re.escape(value)):
        DynamicGradScaler(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(growth_interval=1.5), dict(dynamic="yes"), dict(init_scale="big")])
def test_wrong_types_raise_type_error(kwargs):
    with pytest.raises(TypeError, match="DynamicGradScaler"):
        DynamicGradScaler(**kwargs)


@pytest.mark.parametrize(
    ("spellings", "precision"),
    [((16, "16", "16-mixed"), "16-mixed"), (("bf16", "bf16-mixed"), "bf16-mixed"), (("fp8-mixed",), "fp8-mixed")],
)
def test_every_spelling_lightning_accepts_maps_to_the_same_plugin(spellings, precision):
    plugins = [AccelPrecision(spelling, "cpu") for spelling in spellings]
    assert all(type(p) is AccelPrecision and p.precision == precision for p in plugins)
    assert all((p.scaler is None) is (precision != "16-mixed") for p in plugins)


@pytest.mark.parametrize(
    ("value", "closest"),
    [("fp16-mixed", "16-mixed"), ("fp16", "16-mixed"), ("fp8", "fp8-mixed"), ("bf16-mix", "bf16-mixed")],
)
def test_an_unknown_precision_names_the_closest_one_and_no_gpu(value, closest):
    with pytest.raises(ValueError, match=re.escape(f"Did you mean {closest!r}? Fix: pass precision={closest!r}")) as e:
        AccelPrecision(value)
    assert "Ampere" not in str(e.value) and "GPU" not in str(e.value)


@pytest.mark.parametrize("value", [32, "32", "32-true"])
def test_full_precision_is_refused_with_what_to_use_instead(value):
    with pytest.raises(ValueError, match=r"drop the plugin.*Trainer\(precision='32.*'\).*NonFiniteGuard\(\)"):
        AccelPrecision(value)


def test_a_plain_class_that_pickles_without_hooks(tmp_path):
    assert type(AccelPrecision) is type and issubclass(AccelPrecision, MixedPrecision)
    assert not {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__new__"} & set(vars(AccelPrecision))
    configured = AccelPrecision(
        "16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, hysteresis=2), on_min_scale="warn"
    )
    clone = pickle.loads(pickle.dumps(configured))
    assert type(clone) is AccelPrecision and clone.precision == "16-mixed" and clone.min_scale_stop.action == "warn"
    assert (clone.scaler.hysteresis, clone.loss_scale) == (2, 256.0)
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8))
    trainer = _fit(Model(bad_steps={1}, scheduler="step"), plugin, steps=3)
    fitted = pickle.loads(pickle.dumps(plugin))
    assert fitted.state_dict() == plugin.state_dict() and fitted.skipped_steps == 1
    trainer.save_checkpoint(tmp_path / "fitted.ckpt")
    checkpoint = torch.load(tmp_path / "fitted.ckpt", weights_only=True)  # plain data: no lit_accel class inside
    assert checkpoint["AccelPrecision"]["skipped_steps"] == 1 and checkpoint["MixedPrecision"]["scale"] == 128.0


def test_optimizer_step_is_as_linear_as_lightnings():
    """Cyclomatic complexity (1 + branches + extra boolean operands) of optimizer_step stays <= 8."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(AccelPrecision.optimizer_step)))
    branches = (ast.If, ast.For, ast.While, ast.ExceptHandler, ast.IfExp, ast.comprehension, ast.match_case)
    nodes = list(ast.walk(tree))
    complexity = 1 + sum(isinstance(n, branches) for n in nodes)
    complexity += sum(len(n.values) - 1 for n in nodes if isinstance(n, ast.BoolOp))
    assert complexity <= 8
    assert not any(isinstance(n, ast.Try) for n in nodes)  # no decision from an error's text


def test_a_device_that_disagrees_with_the_trainer_is_refused_at_setup():
    plugin = AccelPrecision("16-mixed", "cuda")  # nothing is created on CUDA at construction
    assert plugin.scaler.device is None
    model = Model()
    with pytest.raises(RuntimeError, match=re.escape("AccelPrecision(device='cuda') but the Trainer runs on cpu")):
        _fit(model, plugin, steps=1)
    assert model.training_steps == 0


# ---------------------------------------------------------------------------------------------- fp16 skips


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_overflow_skips_the_step_halves_the_scale_then_grows(optimizer, monkeypatch):
    """Overflow at step 2: weights and optimizer state unchanged, one skip, scale halved; x2 after 3 clean steps."""
    host_reads = []
    original = DynamicGradScaler._maybe_opt_step

    def counting(self, *args, **kwargs):
        host_reads.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DynamicGradScaler, "_maybe_opt_step", counting)
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=3))
    rec = Recorder()
    trainer = _fit(Model(bad_steps={2}, optimizer=optimizer), plugin, steps=6, recorder=rec)
    r = rec.rows
    assert _same(r[2]["params"], r[1]["params"]) and _same(r[2]["opt_state"], r[1]["opt_state"])
    assert not _same(r[3]["params"], r[2]["params"])  # clean steps do update
    assert plugin.skipped_steps == 1 and [row["skipped"] for row in r] == [0, 0, 1, 1, 1, 1]
    # The tracker was 2 (steps 0, 1) when the overflow reset it, so there is no growth before the skip.
    assert [row["scale"] for row in r] == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
    assert trainer.global_step == 6  # attempted steps, the skipped one included
    # Plain optimizers: torch's own per-step read of found-inf, reused. Fused: never (the kernel skips on device).
    assert len(host_reads) == (0 if optimizer == "adamw_fused" else 6)


class MicroBatchOverflowModel(Model):
    """Overflows on one micro-batch (by batch_idx), not on a whole optimizer step."""

    def __init__(self, bad_batch, **kwargs):
        super().__init__(**kwargs)
        self.bad_batch = bad_batch

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * INF if batch_idx == self.bad_batch else loss


def test_an_overflow_in_one_micro_batch_skips_the_whole_accumulation_window(monkeypatch):
    unscales = []
    original = DynamicGradScaler.unscale_
    monkeypatch.setattr(DynamicGradScaler, "unscale_", lambda self, opt: unscales.append(1) or original(self, opt))
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8))
    rec = Recorder()
    # Windows of 2 micro-batches: batches (0, 1), (2, 3), (4, 5); batch 2 (first of the second window) overflows.
    _fit(MicroBatchOverflowModel(2), plugin, steps=3, recorder=rec, accumulate_grad_batches=2)
    window_ends = rec.rows[1::2]  # the rows are per batch; the optimizer steps after batches 1, 3 and 5
    assert [row["step"] for row in rec.rows] == [0, 1, 1, 2, 2, 3]
    assert _same(window_ends[1]["params"], window_ends[0]["params"])  # the whole second window was skipped
    assert [row["skipped"] for row in window_ends] == [0, 1, 1]
    assert len(unscales) == 3  # one unscale per optimizer step, not per micro-batch


def test_hysteresis_two_skips_once_without_backing_off_and_backs_off_on_the_second_in_a_row():
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, hysteresis=2, growth_interval=100))
    rec = Recorder()
    _fit(Model(bad_steps={1, 3, 4}), plugin, steps=6, recorder=rec)
    r = rec.rows
    assert [row["scale"] for row in r] == [256.0, 256.0, 256.0, 256.0, 128.0, 128.0]
    assert [row["streak"] for row in r] == [0, 1, 0, 1, 0, 0]
    assert [row["skipped"] for row in r] == [0, 1, 1, 2, 3, 3]
    for skipped_step in (1, 3, 4):
        assert _same(r[skipped_step]["params"], r[skipped_step - 1]["params"])
    stats = plugin.scaler.scaler_stats()
    assert (stats.backoffs.item(), stats.growths.item()) == (1, 0)


def test_loss_scaling_rescues_gradients_that_flush_to_zero_in_fp16():
    """loss x 1e-9 (lr x 1e9 keeps the maths of an lr=0.05 run): fp16 gradients ~1e-10 flush to zero unscaled."""
    steps, lr = 6, 0.05
    pl.seed_everything(0)
    reference = Model(optimizer="sgd", lr=lr)
    initial = params_of(reference)
    _fit(reference, None, steps)

    def run(plugin):
        pl.seed_everything(0)
        model = Model(optimizer="sgd", lr=lr * 1e9, loss_factor=1e-9)
        _fit(model, plugin, steps)
        return params_of(model)

    scaled = run(AccelPrecision("16-mixed"))
    unscaled = run(AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=1.0, dynamic=False)))
    assert _same(unscaled, initial)  # every gradient flushed to zero: nothing learned
    moved = max((params_of(reference)[k] - initial[k]).abs().max().item() for k in initial)
    error = max((scaled[k] - params_of(reference)[k]).abs().max().item() for k in initial)
    assert moved > 0.05 and error < 0.02 * moved  # learned what fp32 learned, within fp16 rounding


@pytest.mark.parametrize(
    ("optimizer", "hysteresis", "check_every", "raised_at", "first_hit"),
    [
        # 16 -> 8 -> 4 -> 2 -> 1 in steps 0-3 (log2(16/1) back-offs); step 4 overflows at the minimum.
        ("adamw", 1, 100, 4, 4),
        # Each back-off needs 2 overflows in a row: 1 is reached at step 7, the hit comes at step 9.
        ("adamw", 2, 100, 9, 9),
        # Fused: the device counter is read every 3rd step (steps 2, 5, ...): the hit at step 4 is seen at step 5.
        ("adamw_fused", 1, 3, 5, 4),
    ],
)
def test_always_overflowing_loss_stops_at_min_scale_with_an_explanation(
    optimizer, hysteresis, check_every, raised_at, first_hit
):
    scaler = DynamicGradScaler(init_scale=16.0, min_scale=1.0, hysteresis=hysteresis)
    plugin = AccelPrecision("16-mixed", scaler=scaler, min_scale_check_interval=check_every)
    model = Model(bad_steps={"all"}, optimizer=optimizer)
    initial = params_of(model)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=100, plugins=[plugin]))
    with pytest.raises(RuntimeError, match="min_scale=1") as info:
        trainer.fit(model, make_loader(make_dataset(800), 8))
    message = str(info.value)
    assert trainer.global_step == raised_at
    assert f"first overflow at the minimum: optimizer step {first_hit}" in message
    for fix in ("bf16-mixed", "learning rate", "data", "on_min_scale='warn'"):
        assert fix in message
    if optimizer == "adamw" and hysteresis == 1:
        assert f"optimizer step {raised_at} (batch_idx {raised_at})" in message
        assert "step 0: 8, step 1: 4, step 2: 2, step 3: 1, step 4: 1" in message
    assert _same(params_of(model), initial)


def test_on_min_scale_warn_keeps_skipping_at_min_scale():
    plugin = AccelPrecision("16-mixed", on_min_scale="warn", scaler=DynamicGradScaler(init_scale=4.0, min_scale=1.0))
    model = Model(bad_steps={"all"})
    with pytest.warns(UserWarning, match="on_min_scale='warn'") as record:
        _fit(model, plugin, steps=8)
    assert sum("min_scale" in str(w.message) for w in record) == 1  # once, not every step
    assert plugin.loss_scale == 1.0 and plugin.skipped_steps == 8


@pytest.mark.parametrize(
    ("precision", "optimizer", "kwargs", "scheduler", "expected"),
    [
        # The table in AccelPrecision's docstring, over 6 clean steps.
        ("16-mixed", "adamw", {}, None, 6),  # torch's found-inf read in GradScaler.step, reused
        ("16-mixed", "adamw_fused", dict(min_scale_check_interval=4), None, 1),  # the periodic min-scale read
        ("16-mixed", "adamw_fused", {}, "step", 6),  # the scheduler needs to know about skips
        # bf16 + NonFiniteGuard(**kwargs)
        ("bf16-mixed", "adamw", {}, None, 6),  # whether the step may run
        ("bf16-mixed", "adamw", dict(action="skip"), "step", 6),  # the same read; the scheduler reuses it
        ("bf16-mixed", "adamw_fused", dict(action="skip"), None, 0),
        ("bf16-mixed", "adamw_fused", {}, None, 0),  # action="raise": read later from a host copy
        ("bf16-mixed", "adamw_fused", dict(action="skip"), "step", 6),  # the scheduler needs to know about skips
    ],
)
def test_host_reads_per_step_match_the_documented_table(monkeypatch, precision, optimizer, kwargs, scheduler, expected):
    """Count the device-to-host reads made by lit_accel code (the syncs on a GPU) during training."""
    import sys

    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kw):
            if "/lit_accel/" in sys._getframe(1).f_code.co_filename:
                reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    if precision == "16-mixed":
        plugin, callbacks = AccelPrecision(precision, scaler=DynamicGradScaler(init_scale=2.0**8), **kwargs), []
    else:
        plugin, callbacks = AccelPrecision(precision), [NonFiniteGuard(**kwargs)]
    _fit(Model(optimizer=optimizer, scheduler=scheduler), plugin, steps=6, callbacks=callbacks)
    assert len(reads) == expected, reads


# ---------------------------------------------------------------------------------------------- schedulers


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_step_lr_is_not_advanced_on_a_skipped_step(optimizer):
    rec = Recorder()
    trainer = _fit(
        Model(bad_steps={2}, scheduler="step", optimizer=optimizer, lr=0.1),
        AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8)),
        steps=5,
        recorder=rec,
    )
    # Steps actually taken so far: the attempted ones minus the skipped ones.
    taken = [row["step"] - row["skipped"] for row in rec.rows]
    assert taken == [1, 2, 2, 3, 4]
    assert [row["lr"] for row in rec.rows] == [0.1 * 0.5**k for k in taken]
    assert trainer.global_step == 5
    wrapper = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(wrapper, SkipAwareScheduler) and type(wrapper.scheduler) is torch.optim.lr_scheduler.StepLR
    assert wrapper.record is trainer.precision_plugin and isinstance(wrapper.record, SkippedStepRecord)


def test_upstream_still_skip_aware_schedulers():
    """The behaviour AccelPrecision fixes (Lightning #5558, #18828), so the test above can fail."""
    rec = Recorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    _fit(Model(bad_steps={2}, scheduler="step", lr=0.1), MixedPrecision("16-mixed", "cpu", scaler), 5, rec)
    assert [row["lr"] for row in rec.rows] == [0.1 * 0.5**k for k in range(1, 6)]


def test_skip_aware_scheduler_keeps_its_state_dict_and_checkpoints_load_into_plain_lightning(tmp_path):
    trainer = _fit(
        Model(scheduler="step"), AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8)), steps=2
    )
    wrapper = trainer.lr_scheduler_configs[0].scheduler
    fresh = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), 1)
    assert (
        wrapper.state_dict() == wrapper.scheduler.state_dict()
        and wrapper.state_dict().keys() == fresh.state_dict().keys()
    )
    assert wrapper.get_last_lr() == wrapper.scheduler.get_last_lr() and wrapper.optimizer is trainer.optimizers[0]
    assert type(pickle.loads(pickle.dumps(wrapper))) is SkipAwareScheduler  # ordinary pickling
    trainer.save_checkpoint(tmp_path / "accel.ckpt")
    # Plain Lightning (its own MixedPrecision, a plain StepLR) resumes from it: the scheduler's state is its own.
    plain = pl.Trainer(**small_trainer_kwargs(max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu")]))
    plain.fit(Model(scheduler="step"), make_loader(make_dataset(64), 8), ckpt_path=tmp_path / "accel.ckpt")
    resumed = plain.lr_scheduler_configs[0].scheduler
    assert type(resumed) is torch.optim.lr_scheduler.StepLR and resumed.last_epoch == 3
    epoch_trainer = _fit(
        Model(scheduler="epoch"), AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8)), steps=2
    )
    assert type(epoch_trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.StepLR


# ---------------------------------------------------------------------------------------------- clipping


def _manual_fp16_run(optimizer: str, algorithm: str | None, clip: float, steps: int, init_scale: float):
    """What the plugin must do, written out with torch: fp16 autocast, scale, unscale, clip, step, update."""
    pl.seed_everything(0)
    model = Model(optimizer=optimizer)
    opt = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    norms = []
    for step, (x, y) in enumerate(make_loader(make_dataset(64), 8)):
        if step == steps:
            break
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elif algorithm == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return params_of(model), norms


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_clipping_acts_on_unscaled_gradients(algorithm, optimizer):
    clip, steps, init_scale = 0.05, 3, 2.0**10
    expected, norms = _manual_fp16_run(optimizer, algorithm, clip, steps, init_scale)
    unclipped, _ = _manual_fp16_run(optimizer, None, clip, steps, init_scale)
    assert min(norms) > clip and not _same(expected, unclipped)  # the clip was active

    pl.seed_everything(0)
    model = Model(optimizer=optimizer)
    _fit(
        model,
        AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=init_scale)),
        steps,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
    )
    assert _same(params_of(model), expected)


class ManualClipModel(Model):
    """Manual optimization that clips between backward and step (Lightning's MixedPrecision clips scaled grads)."""

    def __init__(self, clip, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()


def test_manual_optimization_clips_unscaled_gradients():
    clip, steps, init_scale = 0.05, 3, 2.0**10
    expected, _ = _manual_fp16_run("sgd", "norm", clip, steps, init_scale)
    pl.seed_everything(0)
    model = ManualClipModel(clip, optimizer="sgd")
    _fit(model, AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=init_scale)), steps)
    assert _same(params_of(model), expected)


class LegacyScalingSGD(torch.optim.SGD):
    """torch's deprecated contract: receives step(grad_scaler=...) and unscales by itself."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self._step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        raise AssertionError("must be refused before the first step")


class LegacyModel(Model):
    def configure_optimizers(self):
        return LegacyScalingSGD(self.parameters(), lr=0.1)


def test_clipping_with_an_optimizer_that_unscales_itself_is_refused_before_the_first_step():
    model = LegacyModel()
    with pytest.raises(ValueError, match=r"LegacyScalingSGD.*clip"):
        _fit(model, AccelPrecision("16-mixed"), steps=2, gradient_clip_val=1.0)
    assert model.training_steps == 0


def test_lbfgs_with_fp16_is_refused_before_the_first_step():
    model = Model(optimizer="lbfgs")
    with pytest.raises(TypeError, match="LBFGS"):
        _fit(model, AccelPrecision("16-mixed"), steps=2)
    assert model.training_steps == 0


# ---------------------------------------------------------------------------------------------- checkpoints


def _resume_case(tmp_path, drop_precision_state=False):
    """8 steps straight vs 4 + checkpoint + 4: hysteresis streak, growth tracker and counters must carry over."""

    def plugin():
        return AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, hysteresis=2, growth_interval=3))

    def model():
        pl.seed_everything(0)
        return Model(bad_steps={1, 3, 4}, scheduler="step", lr=0.1)

    # One batch per epoch, so every step sees the same data: Lightning 2.6 itself replays the first batch when it
    # resumes from an end-of-epoch checkpoint (seen in plain fp32), which must not blur what this test checks.
    kwargs = dict(loader_n=8)
    straight_plugin = plugin()
    straight = model()
    straight_trainer = _fit(straight, straight_plugin, 8, **kwargs)

    first_plugin = plugin()
    first_trainer = _fit(model(), first_plugin, 4, **kwargs)
    assert first_plugin.scaler.scaler_stats().overflow_streak.item() == 1  # the overflow at step 3 is pending
    path = tmp_path / "mid.ckpt"
    first_trainer.save_checkpoint(path)
    if drop_precision_state:
        ckpt = torch.load(path, weights_only=False)
        del ckpt["AccelPrecision"], ckpt["MixedPrecision"]  # the scale is written under both keys
        torch.save(ckpt, path)

    resumed_plugin = plugin()
    resumed = model()
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=8, plugins=[resumed_plugin]))
    trainer.fit(resumed, make_loader(make_dataset(8), 8), ckpt_path=path)
    return (straight, straight_plugin, straight_trainer), (resumed, resumed_plugin, trainer)


def test_resume_restores_scaler_state_and_continues_bit_identically(tmp_path):
    (straight, sp, st), (resumed, rp, rt) = _resume_case(tmp_path)
    assert rt.global_step == st.global_step == 8
    assert _same(params_of(resumed), params_of(straight))
    assert _same(rt.optimizers[0].state_dict()["state"], st.optimizers[0].state_dict()["state"])
    assert rt.optimizers[0].param_groups[0]["lr"] == st.optimizers[0].param_groups[0]["lr"]
    assert rp.state_dict() == sp.state_dict()
    scaler_state = sp.state_dict()  # the scaler's entries at the top level, under torch's keys
    assert (scaler_state["skipped_steps"], scaler_state["backoffs"]) == (3, 1)


def test_resume_without_the_precision_state_diverges(tmp_path):
    """Control for the test above: a fresh scaler after resume does not back off at step 4 and loses the counters.

    (The weights still agree: a power-of-two scale changes fp16 gradients exactly, so the unscaled ones match.)
    """
    (_, sp, _), (_, rp, _) = _resume_case(tmp_path, drop_precision_state=True)
    # Straight: overflows at 1, 3, 4 -> back-off to 128 at step 4 (second in a row), clean 5-7 -> growth to 256.
    assert (sp.loss_scale, sp.skipped_steps) == (256.0, 3)
    # Fresh scaler from step 4: a lone overflow (no back-off), clean 5-7 -> growth from 256 to 512; one skip seen.
    assert (rp.loss_scale, rp.skipped_steps) == (512.0, 1)


def test_state_loaded_before_the_scaler_exists_is_applied_in_setup():
    donor = AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**8))
    donor.scaler.update(new_scale=32.0)
    state = donor.state_dict()
    plugin = AccelPrecision("16-mixed")  # device=None: the scaler is placed in connect()
    plugin.load_state_dict(state)
    assert plugin.scaler.device is None and plugin.state_dict() == state and plugin.loss_scale == 32.0
    rec = Recorder()
    _fit(Model(), plugin, steps=1, recorder=rec)
    assert rec.rows[0]["scale"] == 32.0


def test_takes_the_scaler_state_of_a_lightning_mixed_precision_checkpoint():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    torch_scaler.scale(torch.ones(()))
    torch_scaler.update(new_scale=64.0)
    plugin = AccelPrecision("16-mixed", "cpu")
    plugin.on_load_checkpoint({"MixedPrecision": torch_scaler.state_dict()})
    assert plugin.loss_scale == 64.0


# ---------------------------------------------------------------------------------------------- contract


def test_public_state_contract():
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8))
    trainer = _fit(Model(bad_steps={1}), plugin, steps=3)
    assert trainer.scaler is plugin.scaler and isinstance(plugin.scaler, torch.amp.GradScaler)
    assert isinstance(plugin.scaler, ScalerStatsProvider) and not isinstance(plugin, ScalerStatsProvider)
    assert isinstance(plugin, SkippedStepRecord) and not plugin.step_was_skipped()  # step 2 was clean
    stats = plugin.scaler.scaler_stats()
    assert stats._fields == ("scale", "growth_tracker", "overflow_streak", "skipped_steps", "growths", "backoffs")
    assert stats.scale.dtype == torch.float32 and all(t.dtype == torch.int64 for t in stats[1:])
    values = torch.stack([t.double() for t in stats]).tolist()
    assert values == [plugin.loss_scale, 1.0, 0.0, plugin.skipped_steps, 0.0, 1.0]
    assert isinstance(plugin.skipped_steps, int) and isinstance(plugin.loss_scale, float)

    bf16 = AccelPrecision("bf16-mixed")
    assert bf16.scaler is None and bf16.loss_scale == 1.0 and bf16.skipped_steps == 0
    with pytest.raises(RuntimeError, match="scaler_stats"):
        AccelPrecision("16-mixed").scaler.scaler_stats()  # no device before fit


# ---------------------------------------------------------------------------------------------- DDP


def _ddp_fp16(rank, world_size):
    """Two fits in the same process group: Lightning's DDPStrategy, then lit_accel's AccelDDP."""
    from lit_accel import AccelDDP

    results = {}
    for name, strategy in (("ddp", DDPStrategy()), ("accel_ddp", AccelDDP(sync_batchnorm=False))):
        pl.seed_everything(0)
        # Each rank overflows on its own step; DDP all-reduces the inf into both ranks' gradients.
        model = Model(bad_steps={2} if rank == 1 else {4})
        plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=100))
        rec = Recorder()
        trainer = pl.Trainer(
            **small_trainer_kwargs(
                devices=world_size,
                strategy=strategy,
                max_steps=6,
                plugins=[plugin],
                callbacks=[rec],
                use_distributed_sampler=False,
            )
        )
        initial = params_of(model)
        trainer.fit(model, make_loader(make_dataset(96), 8, rank, world_size))
        results[name] = dict(
            params=params_of(model),
            moved=not _same(params_of(model), initial),
            skips=[row["skipped"] for row in rec.rows],
            scales=[row["scale"] for row in rec.rows],
        )
    return results


def test_ddp_fp16_ranks_skip_the_same_steps_and_stay_identical():
    results = run_distributed(_ddp_fp16, 2, init_process_group=False, timeout=60)
    for name in ("ddp", "accel_ddp"):
        r0, r1 = results[0][name], results[1][name]
        assert r0["skips"] == r1["skips"] == [0, 0, 1, 1, 2, 2]
        assert r0["scales"] == r1["scales"] == [256.0, 256.0, 128.0, 128.0, 64.0, 64.0]
        assert _same(r0["params"], r1["params"])
        assert r0["moved"] and all(torch.isfinite(v).all() for v in r0["params"].values())
    assert _same(results[0]["ddp"]["params"], results[0]["accel_ddp"]["params"])


OVERFLOWS_ON_RANK_1 = (1, 2, 6)  # two in a row, then one after a growth


def _overflow_on_one_rank(rank, world_size):
    from lit_accel import AccelDDP

    pl.seed_everything(0)
    model = Model(bad_steps=OVERFLOWS_ON_RANK_1 if rank == 1 else (), scheduler="step", lr=0.1)
    plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=2))
    rec = Recorder()
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            devices=world_size,
            strategy=AccelDDP(sync_batchnorm=False),
            max_steps=9,
            plugins=[plugin],
            callbacks=[rec],
            use_distributed_sampler=False,
        )
    )
    trainer.fit(model, make_loader(make_dataset(144), 8, rank, world_size))
    return rec.rows


def _torch_scales(overflows, steps, **kwargs):
    """torch's GradScaler, fed the same overflows: its scale after each step."""
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scales = []
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(param.sum() * (INF if step in overflows else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_an_overflow_on_one_rank_is_skipped_on_both_holds_the_lr_and_scales_as_torch():
    """fp16 on 2 gloo ranks, overflows on rank 1 only: every rank skips those steps (weights and optimizer state
    unchanged), the step-interval LR schedule holds still on them, and the scale follows torch's GradScaler."""
    ranks = run_distributed(_overflow_on_one_rank, 2, init_process_group=False, timeout=120)
    expected_scales = _torch_scales(OVERFLOWS_ON_RANK_1, 9, init_scale=2.0**8, growth_interval=2)
    assert expected_scales == [256.0, 128.0, 64.0, 64.0, 128.0, 128.0, 64.0, 64.0, 128.0]  # grew and backed off
    for rows in ranks:
        assert [row["scale"] for row in rows] == expected_scales
        taken = 0
        for step, row in enumerate(rows):
            skipped = step in OVERFLOWS_ON_RANK_1
            before = rows[step - 1] if step else None
            if skipped:
                assert _same(row["params"], before["params"]) and _same(row["opt_state"], before["opt_state"])
            else:
                taken += 1
                assert before is None or not _same(row["params"], before["params"])
            assert row["lr"] == 0.1 * 0.5**taken, (step, row["lr"])  # StepLR(gamma=0.5) per step actually taken
        assert [row["skipped"] for row in rows][-1] == len(OVERFLOWS_ON_RANK_1)
    assert all(_same(a["params"], b["params"]) for a, b in zip(*ranks))  # the ranks stay identical
