"""DynamicGradScaler on its own: the update policy against torch and against a plain-Python statement of the rules."""

import pickle
import random

import pytest
import torch

from lit_accel.plugins.grad_scaler import DynamicGradScaler, ScalerStats
from lit_accel.protocols import ScalerStatsProvider
from lit_accel.utilities import _compat


def _step(scaler, param, opt, overflow: bool) -> None:
    """One iteration: scaled backward of a simple loss, inf injected into the gradient on overflow steps."""
    opt.zero_grad()
    scaler.scale((param**2).sum()).backward()
    if overflow:
        param.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()


def _param_and_opt(fused: bool = False):
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5))
    return param, torch.optim.AdamW([param], lr=0.01, fused=fused)


def _reference_policy(pattern, init, growth, backoff, interval, hysteresis, min_scale, max_scale):
    """The rules of docs/precision.md ("Loss scaling"), one Python line each: the tensor implementation's reference."""
    scale, tracker, streak = init, 0, 0
    skipped = growths = backoffs = hits = 0
    trace = []
    for overflow in pattern:
        if overflow:
            skipped += 1
            tracker = 0
            streak += 1
            if streak >= hysteresis:
                streak = 0
                if scale <= min_scale:
                    hits += 1
                new = max(scale * backoff, min_scale)
                backoffs += new < scale
                scale = new
        else:
            streak = 0
            tracker += 1
            if tracker >= interval:
                tracker = 0
                new = min(scale * growth, max_scale)
                growths += new > scale
                scale = new
        trace.append((scale, tracker, streak, skipped, growths, backoffs, hits))
    return trace


def test_hysteresis_one_matches_torch_exactly():
    """With hysteresis=1 and no bounds in reach, scale, tracker and weights equal torch.amp.GradScaler's."""
    rng = random.Random(0)
    pattern = [rng.random() < 0.3 for _ in range(40)]
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = DynamicGradScaler("cpu", **kwargs, min_scale=2.0**-30, max_scale=2.0**40)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    p1, o1 = _param_and_opt()
    p2, o2 = _param_and_opt()
    for overflow in pattern:
        _step(ours, p1, o1, overflow)
        _step(theirs, p2, o2, overflow)
        assert ours.get_scale() == theirs.get_scale()
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
    assert torch.equal(p1, p2)
    assert sum(pattern) > 5 and ours.get_scale() != 2.0**10  # the pattern exercised growth and back-off


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_policy_matches_the_reference_rules_with_bounds(hysteresis):
    rng = random.Random(hysteresis)
    # Long overflow bursts drive the scale to min_scale (hits); clean runs drive it to max_scale.
    pattern = [True] * 14 + [rng.random() < 0.5 for _ in range(30)] + [False] * 12 + [True, True, False] * 3
    settings = dict(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    bounds = dict(hysteresis=hysteresis, min_scale=0.5, max_scale=32.0)
    scaler = DynamicGradScaler("cpu", **settings, **bounds)
    expected = _reference_policy(pattern, 8.0, 2.0, 0.5, 2, hysteresis=hysteresis, min_scale=0.5, max_scale=32.0)
    param, opt = _param_and_opt()
    for overflow, row in zip(pattern, expected):
        _step(scaler, param, opt, overflow)
        s = scaler.scaler_stats()
        got = (
            s.scale.item(),
            s.growth_tracker.item(),
            s.overflow_streak.item(),
            s.skipped_steps.item(),
            s.growths.item(),
            s.backoffs.item(),
            scaler.counter("min_scale_hits").item(),
        )
        assert got == row
    final = expected[-1]
    assert final[6] > 0 and final[4] > 0  # reached both bounds' behaviours: min-scale hits and growths
    assert max(r[0] for r in expected) == 32.0 and min(r[0] for r in expected) == 0.5
    assert scaler.counter("steps").item() == len(pattern)


def test_first_min_scale_hit_records_the_step_index():
    scaler = DynamicGradScaler("cpu", init_scale=4.0, min_scale=1.0)
    param, opt = _param_and_opt()
    for _ in range(5):
        _step(scaler, param, opt, overflow=True)
    # 4 -> 2 -> 1 in steps 0 and 1; step 2 overflows at the minimum.
    assert scaler.read_min_scale_state() == (1.0, 3, 2)


def test_static_scaling_keeps_the_scale_and_still_skips():
    scaler = DynamicGradScaler("cpu", init_scale=4.0, dynamic=False)
    param, opt = _param_and_opt()
    _step(scaler, param, opt, overflow=False)
    before = param.detach().clone()
    _step(scaler, param, opt, overflow=True)
    assert torch.equal(param, before)
    for _ in range(3):
        _step(scaler, param, opt, overflow=False)
    s = scaler.scaler_stats()
    assert (s.scale.item(), s.skipped_steps.item(), s.growths.item(), s.backoffs.item()) == (4.0, 1, 0, 0)


def _skipped_between_step_and_update(scaler, param, opt, overflow: bool):
    opt.zero_grad()
    scaler.scale((param**2).sum()).backward()
    if overflow:
        param.grad[0] = float("inf")
    scaler.step(opt)
    skipped = _compat.grad_scaler_step_skipped(scaler, opt)
    scaler.update()
    return skipped


def test_skip_is_known_on_the_host_for_plain_optimizers_and_on_device_for_fused(monkeypatch):
    # DynamicGradScaler keeps torch's own host read of the found-inf flags (plain optimizers): no second read.
    reads = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or original(self))
    plain = DynamicGradScaler("cpu", init_scale=4.0)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)  # AdamW's CPU step reads its step count with .item() itself
    assert _compat.grad_scaler_step_skipped(plain, opt) is False  # nothing recorded yet
    assert _skipped_between_step_and_update(plain, param, opt, overflow=True) is True
    assert _skipped_between_step_and_update(plain, param, opt, overflow=False) is False
    assert len(reads) == 2  # torch's one read per step, in GradScaler.step, and none more

    fused = DynamicGradScaler("cpu", init_scale=4.0)
    param, opt = _param_and_opt(fused=True)
    flag = _skipped_between_step_and_update(fused, param, opt, overflow=True)
    assert isinstance(flag, torch.Tensor) and flag.item() > 0
    assert _skipped_between_step_and_update(fused, param, opt, overflow=False).item() == 0
    # A plain torch GradScaler keeps no host copy: the device flag, for plain optimizers too.
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    param, opt = _param_and_opt()
    assert _skipped_between_step_and_update(torch_scaler, param, opt, overflow=True).item() > 0


def test_stats_are_device_tensor_snapshots():
    scaler = DynamicGradScaler("cpu", init_scale=4.0)
    param, opt = _param_and_opt()
    _step(scaler, param, opt, overflow=True)
    stats = scaler.scaler_stats()
    assert isinstance(scaler, ScalerStatsProvider) and scaler.loss_scaling  # what LossScaleMonitor reads
    assert isinstance(stats, ScalerStats)
    assert stats.scale.dtype == torch.float32
    assert all(t.dtype == torch.int64 and t.shape == () for t in stats[1:])
    _step(scaler, param, opt, overflow=True)
    assert stats.skipped_steps.item() == 1 and stats.scale.item() == 2.0  # a snapshot, not the live tensors
    assert scaler.scaler_stats().skipped_steps.item() == 2


def test_state_dict_round_trip_and_settings_from_the_constructor():
    a = DynamicGradScaler("cpu", init_scale=64.0, growth_interval=3, hysteresis=2)
    param, opt = _param_and_opt()
    for overflow in [False, True, True, False, True]:
        _step(a, param, opt, overflow)
    state = a.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["overflow_streak"]) == (32.0, 0, 1)
    assert (state["skipped_steps"], state["backoffs"], state["steps"]) == (3, 1, 5)

    b = DynamicGradScaler("cpu", init_scale=64.0, growth_interval=7, hysteresis=2, min_scale=0.25)
    b.load_state_dict(state)
    assert b.state_dict() | {"growth_interval": 3, "min_scale": 1.0} == state
    assert b.get_growth_interval() == 7 and b.min_scale == 0.25  # settings stay the constructor's

    clamped = DynamicGradScaler("cpu", init_scale=64.0, min_scale=64.0)
    clamped.load_state_dict(state)
    assert clamped.get_scale() == 64.0


def test_loads_a_plain_torch_grad_scaler_state():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=4)
    param, opt = _param_and_opt()
    for overflow in [False, True, False]:
        _step(torch_scaler, param, opt, overflow)
    ours = DynamicGradScaler("cpu", growth_interval=4)
    ours.load_state_dict(torch_scaler.state_dict())
    assert ours.get_scale() == torch_scaler.get_scale() == 256.0
    assert ours._get_growth_tracker() == 1
    assert ours.scaler_stats().skipped_steps.item() == 0  # counters torch does not keep start at zero


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(backoff_factor=1.0), "backoff_factor=1.0"),
        (dict(growth_factor=1.0), "growth_factor=1.0"),
        (dict(init_scale=0.0), "init_scale=0.0"),
        (dict(min_scale=8.0, init_scale=4.0), "min_scale=8.0"),
    ],
)
def test_bad_settings_name_the_class_and_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=f"DynamicGradScaler\\({needle}"):
        DynamicGradScaler("cpu", **kwargs)


def test_pickle_round_trip_keeps_scale_tracker_and_counters():
    scaler = DynamicGradScaler("cpu", init_scale=64.0, growth_interval=5, hysteresis=2)
    param, opt = _param_and_opt()
    for overflow in [True, True, False, False, True]:
        _step(scaler, param, opt, overflow)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    _step(clone, param, opt, overflow=True)  # and it keeps working: second overflow in a row backs off
    assert clone.get_scale() == 16.0


def test_a_meter_attaches_before_the_scaler_has_a_device():
    # Fabric builds the plugin (and the scaler) before it knows the device: the meter waits instead of raising.
    from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision

    from lit_accel import LossScaleMeter

    scaler = DynamicGradScaler(init_scale=8.0)
    meter = LossScaleMeter()
    assert meter.attach(FabricMixedPrecision("16-mixed", "cpu", scaler=scaler))
    scaler.to("cpu")
    assert meter.compute(0)["loss_scale"] == 8.0


@pytest.mark.parametrize(("hysteresis", "dynamic"), [(1, True), (2, True), (3, True), (1, False)])
def test_clean_steps_kept_on_the_host_read_late_equal_the_rules(hysteresis, dynamic):
    """Read only now and then (clean steps are written to the device at reads): every count as the rules say."""
    rng = random.Random(hysteresis)
    pattern = [rng.random() < 0.15 for _ in range(60)] + [True] * 4 + [False] * 9
    scaler = DynamicGradScaler("cpu", init_scale=8.0, growth_interval=4, hysteresis=hysteresis, min_scale=0.5,
                               max_scale=64.0, dynamic=dynamic)  # fmt: skip
    expected = _reference_policy(pattern, 8.0, 2.0, 0.5, 4, hysteresis=hysteresis, min_scale=0.5, max_scale=64.0)
    param, opt = _param_and_opt()
    for i, (overflow, row) in enumerate(zip(pattern, expected)):
        _step(scaler, param, opt, overflow)
        if i % 17 == 16 or i == len(pattern) - 1:
            state = scaler.state_dict()
            got = [state[k] for k in ("scale", "_growth_tracker", "overflow_streak", "skipped_steps", "growths",
                                      "backoffs", "min_scale_hits")]  # fmt: skip
            if dynamic:
                assert tuple(got) == row, i
            else:  # a static scale: skips counted, nothing else moves
                assert got == [8.0, 0, got[2], sum(pattern[: i + 1]), 0, 0, 0], i
            assert state["steps"] == i + 1
    assert sum(pattern) > 8 and (not dynamic or expected[-1][4] > 0)  # overflows, and growths where dynamic


def test_a_clean_step_runs_no_tensor_op_in_update_and_copies_no_scale():
    """The common step: the host knows it was clean (plain optimizer) and no growth is due; torch's update runs one."""
    from tests.helpers.dispatch import OpRecorder

    ours, theirs = DynamicGradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
    recorded = {}
    for name, scaler in (("ours", ours), ("theirs", theirs)):
        param, opt = _param_and_opt()
        _step(scaler, param, opt, overflow=True)  # an update that moved the scale: the next backward copies it
        for _ in range(2):
            opt.zero_grad()
            loss = (param**2).sum()
            with OpRecorder() as scale_ops:
                scaled = scaler.scale(loss)
            scaled.backward()
            scaler.step(opt)
            with OpRecorder() as update_ops:
                scaler.update()
            recorded[name] = (scale_ops.ops, update_ops.ops)
    assert recorded["ours"][1] == [] and len(recorded["theirs"][1]) >= 1  # torch: its update kernel
    assert recorded["ours"][0] == recorded["theirs"][0]  # the scale multiplication only: no copy of the scale
    assert ours.get_scale() == theirs.get_scale() == 2.0 and ours._get_growth_tracker() == 2
