"""NonFiniteGuard in real (CPU) Trainer runs: bf16 and fp32 steps with inf/NaN gradients never reach the weights.

With lit_accel's ``AccelPrecision("bf16-mixed")``, Lightning's own ``MixedPrecision("bf16-mixed")`` and Lightning's
default full precision (no plugin); plain and fused optimizers.
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lit_accel import AccelPrecision, DynamicGradScaler, NonFiniteGuard
from lit_accel.utilities._workarounds import SkipAwareScheduler
from tests.helpers import lightning_info_messages, make_dataset, make_loader, run_distributed, small_trainer_kwargs
from tests.plugins.test_accel_precision import Model, Recorder, _fit, _same

NAN = float("nan")
# The precision plugin under the guard, by name: lit_accel's bf16, Lightning's own bf16, Lightning's fp32 (none).
PLUGINS = {
    "accel-bf16": lambda: AccelPrecision("bf16-mixed", "cpu"),
    "lightning-bf16": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "32-true": lambda: None,
}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_nonfinite_gradients_are_skipped_and_counted(plugin, optimizer):
    guard, rec = NonFiniteGuard(action="skip"), Recorder()
    model = Model(bad_steps={2}, bad_value=NAN, optimizer=optimizer)
    _fit(model, PLUGINS[plugin](), steps=4, recorder=rec, callbacks=[guard])
    r = rec.rows
    assert _same(r[2]["params"], r[1]["params"]) and _same(r[2]["opt_state"], r[1]["opt_state"])
    assert not _same(r[3]["params"], r[2]["params"])  # and the next step runs
    assert all(torch.isfinite(p).all() for p in r[3]["params"].values())
    assert guard.skipped_steps == 1 and [row["skipped"] for row in r] == [0, 0, 1, 1]


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_nonfinite_gradients_raise_with_step_and_batch_by_default(plugin, optimizer):
    rec = Recorder()
    model = Model(bad_steps={2}, optimizer=optimizer)
    with pytest.raises(RuntimeError, match=re.escape("optimizer step 2 (batch_idx 2)")) as info:
        _fit(model, PLUGINS[plugin](), steps=4, recorder=rec, callbacks=[NonFiniteGuard()])
    assert "NonFiniteGuard(action='skip')" in str(info.value)
    if optimizer == "adamw":  # raised at the bad step itself: nothing written into the weights
        assert _same(dict(model.named_parameters()), rec.rows[1]["params"])
    else:  # fused: the kernel skipped the bad step on the device; the error is read a step later
        assert _same(rec.rows[2]["params"], rec.rows[1]["params"])
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not hasattr(model.trainer.optimizers[0], "found_inf")  # the fused kernel's flag is handed back


@pytest.mark.parametrize(("bad_step", "steps"), [(2, 3), (3, 4), (2, 8)])
def test_fused_guard_reports_a_nonfinite_step_late_but_exactly(bad_step, steps):
    """Fused kernels skip on the device; the flag is read from a host copy exactly two steps later (the same step on
    every rank, whatever the device timing), or at the end of fit for the last steps; the error names the bad step."""
    rec = Recorder()
    model = Model(bad_steps={bad_step}, optimizer="adamw_fused")
    with pytest.raises(RuntimeError, match=re.escape(f"optimizer step {bad_step} (batch_idx {bad_step})")):
        _fit(model, AccelPrecision("bf16-mixed"), steps=steps, recorder=rec, callbacks=[NonFiniteGuard()])
    assert _same(rec.rows[bad_step]["params"], rec.rows[bad_step - 1]["params"])  # the bad step was skipped
    # Raised before the update of step bad_step + 2, or at the end of fit.
    assert len(rec.rows) == min(bad_step + 2, steps)
    assert _same(dict(model.named_parameters()), rec.rows[-1]["params"])


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_a_skipped_step_does_not_move_step_interval_schedulers(optimizer):
    guard, rec = NonFiniteGuard(action="skip"), Recorder()
    model = Model(bad_steps={2}, bad_value=NAN, scheduler="step", optimizer=optimizer, lr=0.1)
    trainer = _fit(model, None, steps=5, recorder=rec, callbacks=[guard])
    taken = [row["step"] - row["skipped"] for row in rec.rows]
    assert taken == [1, 2, 2, 3, 4] and [row["lr"] for row in rec.rows] == [0.1 * 0.5**k for k in taken]
    wrapper = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(wrapper, SkipAwareScheduler) and wrapper.record is guard


def test_the_guard_stands_aside_when_the_loss_is_scaled():
    # fp16: the scaler skips the overflow and backs off; the guard must neither raise nor count it.
    for plugin in (
        AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=2.0**8)),
        MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8)),
    ):
        guard = NonFiniteGuard()
        with lightning_info_messages() as messages:
            _fit(Model(bad_steps={1}), plugin, steps=3, callbacks=[guard])
        assert not guard.active and guard.skipped_steps == 0 and plugin.scaler.get_scale() == 128.0
        assert sum("NonFiniteGuard" in m and "stands aside" in m for m in messages) == 1


def test_accel_precision_says_once_that_bf16_is_unchecked_without_the_guard():
    plugin = AccelPrecision("bf16-mixed")
    with lightning_info_messages() as messages:
        _fit(Model(), plugin, steps=1)
        _fit(Model(), plugin, steps=1)
        _fit(Model(), AccelPrecision("bf16-mixed"), steps=1, callbacks=[NonFiniteGuard()])
    assert sum("add callbacks=[NonFiniteGuard()]" in m for m in messages) == 1


def test_skipped_steps_are_saved_and_restored():
    guard = NonFiniteGuard(action="skip")
    _fit(Model(bad_steps={1, 2}, bad_value=NAN, optimizer="adamw_fused"), None, steps=4, callbacks=[guard])
    restored = NonFiniteGuard(action="skip")
    restored.load_state_dict(guard.state_dict())
    assert guard.state_dict() == {"skipped_steps": 2} and restored.skipped_steps == 2


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match=r"NonFiniteGuard\(action='warn'\).*Fix"):
        NonFiniteGuard(action="warn")  # type: ignore[arg-type]


BAD_STEP = 2


def _nan_in_rank_zeros_shard(rank: int, world_size: int) -> dict[str, object]:
    """AccelFSDP: a NaN in one element of rank 0's gradient shard only; rank 1's shards are all finite."""
    import lightning.pytorch as pl

    from lit_accel import AccelFSDP

    class NaNInOneShard(pl.Callback):  # listed before the guard: Lightning calls callbacks in order
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if rank == 0 and trainer.global_step == BAD_STEP:
                grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
                grad.to_local().view(-1)[0] = NAN  # the local shard of a DTensor gradient

    pl.seed_everything(0, verbose=False)
    model = Model(optimizer="adamw")
    kwargs = small_trainer_kwargs(devices=world_size, max_steps=5, use_distributed_sampler=False)
    trainer = pl.Trainer(strategy=AccelFSDP(), callbacks=[NaNInOneShard(), NonFiniteGuard()], **kwargs)
    try:
        trainer.fit(model, make_loader(make_dataset(80), 8, rank, world_size))
    except RuntimeError as err:
        return {"message": str(err), "step": trainer.global_step}
    return {"message": "", "step": trainer.global_step}


def test_sharded_gradients_are_checked_on_every_rank_together():
    results = run_distributed(_nan_in_rank_zeros_shard, 2, init_process_group=False, timeout=120)
    for result in results:  # rank 1 holds no NaN, yet stops at the same step: the check spans every rank's shards
        assert f"NonFiniteGuard: non-finite gradients (inf/NaN) at optimizer step {BAD_STEP}" in result["message"]
        assert result["step"] == BAD_STEP


@pytest.mark.parametrize("action", ["raise", "skip"])
def test_lbfgs_which_runs_the_closure_itself_is_guarded(action):
    guard, rec = NonFiniteGuard(action=action), Recorder()
    model = Model(bad_steps={2}, bad_value=NAN, optimizer="lbfgs", lr=0.1)
    if action == "raise":
        with pytest.raises(RuntimeError, match=re.escape("optimizer step 2 (batch_idx 2)")):
            _fit(model, None, steps=4, recorder=rec, callbacks=[guard])
        assert _same(dict(model.named_parameters()), rec.rows[1]["params"])
    else:
        _fit(model, None, steps=4, recorder=rec, callbacks=[guard])
        assert _same(rec.rows[2]["params"], rec.rows[1]["params"]) and not _same(
            rec.rows[3]["params"], rec.rows[2]["params"]
        )
        assert guard.skipped_steps >= 1 and all(torch.isfinite(p).all() for p in model.parameters())
