"""The EfficiencyMeter's formulas with exact numbers: exposed communication, stragglers, MFU by dtype, recompiles."""

from __future__ import annotations

import pytest
import torch

from lit_accel import EfficiencyMeter, EfficiencyMonitor
from lit_accel.meters._efficiency_metrics import EfficiencyConfig, RankWindow, window_metrics
from lit_accel.meters._stragglers import StragglerWatch, rank_time, straggler_metrics
from lit_accel.protocols import CommStats, ExposedComm


def _row(**values: float) -> RankWindow:
    # One optimizer step of 10 s by default; every time in seconds.
    return RankWindow(**{"window_s": 10.0, "steps": 1.0, "samples": 4.0, **values})


def test_exposed_comm_and_compute_frac_follow_the_source_documents_formula():
    rows = [
        _row(data_wait_s=2.0, comm_exposed_s=2.0),  # compute 10 - 2 - 2 = 6 s
        _row(data_wait_s=0.0, comm_exposed_s=1.0),  # compute 9 s
    ]
    metrics, _ = window_metrics(rows, 10.0, EfficiencyConfig(), has_comm=True, has_exposed=True)
    assert metrics["comm_exposed_frac"] == (2.0 / 10 + 1.0 / 10) / 2
    # T_compute / (T_compute + T_comm_exposed) over both ranks: (6 + 9) / (6 + 9 + 2 + 1)
    assert metrics["compute_frac"] == pytest.approx(15.0 / 18.0, rel=1e-15)
    without, _ = window_metrics(rows, 10.0, EfficiencyConfig(), has_comm=True, has_exposed=False)
    assert "comm_exposed_frac" not in without and "compute_frac" not in without


def test_communication_shares_are_capped_at_the_window_for_an_estimate_that_exceeds_it():
    # AccelDDP's hookless estimate prices a window's rounds at an earlier sampled round, which can be slower.
    rows = [
        _row(comm_s=12.0, comm_bytes=1.0, comm_exposed_s=11.0),  # estimated above the 10 s window
        _row(comm_s=4.0, comm_bytes=1.0, comm_exposed_s=1.0),
    ]
    metrics, _ = window_metrics(rows, 10.0, EfficiencyConfig(), has_comm=True, has_exposed=True)
    assert metrics["comm_time_frac"] == (1.0 + 0.4) / 2
    assert metrics["comm_exposed_frac"] == (1.0 + 0.1) / 2


# Every window lasts 13 s: the others wait 3 s longer (exposed comm) for the slow rank, whose one part is 3 s longer.
_OTHERS = dict(window_s=13.0, data_wait_s=0.5, forward_s=1.0, backward_s=6.0, backwards=1.0, comm_exposed_s=3.5)
_SLOW_BASE = dict(window_s=13.0, data_wait_s=0.5, forward_s=1.0, backward_s=3.0, backwards=1.0, comm_exposed_s=0.5)


@pytest.mark.parametrize(
    ("slow", "cause"),
    [
        (dict(forward_s=4.0), "compute"),  # forward 1 -> 4 s
        (dict(backward_s=6.0), "compute"),  # backward compute 2.5 -> 5.5 s
        (dict(data_wait_s=3.5), "data loading"),
        (dict(), "host"),  # host = window - data - forward - backward: 5.5 -> 8.5 s
    ],
)
def test_the_straggler_is_the_rank_whose_own_time_stands_out_and_the_part_that_does_is_the_cause(slow, cause):
    rows = [_row(**_OTHERS), _row(**_OTHERS), _row(**{**_SLOW_BASE, **slow}), _row(**_OTHERS)]
    times = [rank_time(r, has_exposed=True) for r in rows]
    assert times[0].own_s == 13.0 - 3.5 and times[2].own_s == 13.0 - 0.5  # own time = window - exposed comm
    assert (times[0].compute_s, times[0].data_s, times[0].host_s) == (3.5, 0.5, 5.5)
    verdict = straggler_metrics(rows, has_exposed=True, threshold=0.2)
    assert verdict.slowest == verdict.rank == 2 and verdict.cause == cause
    assert verdict.excess_frac == 12.5 / 9.5 - 1.0 and verdict.excess_s == 3.0
    assert verdict.metrics() == {"straggler_rank": 2.0, "straggler_excess_frac": verdict.excess_frac}


def test_a_rank_is_named_only_above_the_threshold_and_the_backward_is_left_out_without_exposed_comm():
    rows = [_row(forward_s=1.0, backward_s=8.0, backwards=1.0), _row(forward_s=1.1, backward_s=2.0, backwards=1.0)]
    # Without ExposedComm the backward (holding the wait) is not the rank's own time: 10 - 8 = 2 s against 8 s.
    assert rank_time(rows[0], has_exposed=False).own_s == pytest.approx(2.0)
    assert rank_time(rows[1], has_exposed=False).own_s == pytest.approx(8.0)
    verdict = straggler_metrics(rows, has_exposed=False, threshold=5.0)
    assert (verdict.slowest, verdict.rank, verdict.excess_frac) == (1, -1, pytest.approx(3.0))  # 300% < 500%
    assert straggler_metrics(rows, has_exposed=False, threshold=2.9).rank == 1


def test_straggler_watch_names_a_rank_the_running_average_agrees_on_and_warns_once_with_its_host():
    warnings: list[str] = []
    calls: list[int] = []

    def hosts() -> list[str]:
        calls.append(1)
        return ["node-0", "node-1", "node-2", "node-3"]

    watch = StragglerWatch(3, warnings.append, hosts)
    slow = [_row(forward_s=1.0), _row(forward_s=1.0), _row(forward_s=1.0), _row(forward_s=9.0, data_wait_s=0.5)]
    equal = [_row(forward_s=1.0) for _ in range(4)]
    hiccup = [_row(forward_s=1.0), _row(forward_s=1.5), _row(forward_s=1.0), _row(forward_s=1.0)]  # rank 1: +50%
    named = [
        watch.observe(rows, has_exposed=False, threshold=0.2, step=step).rank
        for step, rows in enumerate([equal, hiccup, equal, slow, slow, equal, slow, slow, slow, slow])
    ]
    # The hiccup window alone is 50% above the others; the running average (newest weighing 1/3) only 17%: nobody is
    # named. A rank that stays slow is named from its first window on.
    assert named == [-1, -1, -1, 3, 3, -1, 3, 3, 3, 3]
    assert len(warnings) == 1 and len(calls) == 1  # the equal window broke the first streak; then once, at step 8
    assert warnings[0].startswith("EfficiencyMeter: rank 3 on host node-3 is the straggler: for 3 logging windows")
    assert "mostly compute" in warnings[0] and "Fix: check that rank's device" in warnings[0]
    assert [r["step"] for r in watch.records] == [3, 4, 6, 7, 8, 9] and watch.records[4]["host"] == "node-3"
    # 9.5 - 1 = 8.5 s more than the others' median, in a window of one step
    assert watch.records[0]["excess_s_per_step"] == pytest.approx(8.5)


def test_the_first_window_alone_names_a_rank_only_far_above_the_threshold():
    def first_verdict(forward_s: float) -> int:
        watch = StragglerWatch(3, print, lambda: ["h"] * 2)
        return watch.observe([_row(forward_s=1.0), _row(forward_s=forward_s)], False, 0.2, 0).rank

    # The running average starts from equal ranks and takes 1/3 of the window: +50% -> +17%, +100% -> +33%.
    assert (first_verdict(1.5), first_verdict(2.0)) == (-1, 1)


def test_mfu_divides_each_dtypes_flops_by_its_own_peak():
    # 4 samples x 100 FLOPs per rank, 2 ranks, 10 s: 600 bf16 FLOPs at 100 FLOP/s = 6 s, 200 fp32 at 50 = 4 s.
    rows = [_row(flops=400.0), _row(flops=400.0)]
    config = EfficiencyConfig(
        flops_per_sample=100.0, flops_by_dtype={"bf16": 75.0, "fp32": 25.0}, peak_flops={"bf16": 100.0, "fp32": 50.0}
    )
    metrics, issue = window_metrics(rows, 10.0, config, has_comm=False)
    assert issue is None and metrics["mfu"] == pytest.approx((6.0 + 4.0) / (2 * 10.0), rel=1e-15)
    # One peak for all dtypes (peak_flops=100): PaLM's flops / (peak x n x W).
    metrics, _ = window_metrics(rows, 10.0, EfficiencyConfig(100.0, peak_flops=100.0), has_comm=False)
    assert metrics["mfu"] == pytest.approx(800.0 / (100.0 * 2 * 10.0))
    # A dtype without a peak: no MFU, and the reason; above 100%: no MFU, flagged as too high.
    missing = EfficiencyConfig(100.0, flops_by_dtype={"fp8": 50.0, "bf16": 50.0}, peak_flops={"bf16": 100.0})
    metrics, issue = window_metrics(rows, 10.0, missing, has_comm=False)
    assert "mfu" not in metrics and not issue.too_high and "no peak for fp8 (50.0% of the FLOPs)" in issue.reason
    metrics, issue = window_metrics(rows, 10.0, EfficiencyConfig(100.0, peak_flops=1.0), has_comm=False)
    assert "mfu" not in metrics and issue.too_high and "MFU would be 4,000%" in issue.reason


class _ExposedCounter:
    """A strategy's counters with the optional ExposedComm protocol: exposed seconds handed out per pop."""

    def __init__(self) -> None:
        self.calls = self.bytes = 0
        self.exposed: list[float] = []

    def pop_elapsed_s(self) -> float:
        return 0.0

    def pop_exposed_s(self) -> float:
        return self.exposed.pop(0) if self.exposed else 0.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_reads_exposed_comm_at_logging_steps_and_counts_recompiles_since_its_reset():
    def scaled(x: torch.Tensor) -> torch.Tensor:  # a frame no other test compiles
        return x * 3

    counter, clock = _ExposedCounter(), _Clock()
    assert isinstance(counter, CommStats) and isinstance(counter, ExposedComm)
    warnings: list[str] = []
    meter = EfficiencyMeter(
        warmup_steps=1, comm_stats=counter, clock=clock, max_recompiles=2, warn=warnings.append, world_size=1
    )
    counter.exposed = [0.5, 1.0]  # popped when the first window opens (the warm-up's, dropped), then at its end
    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    for step in range(5):
        meter.batch_start(2)
        clock.now += 1.0
        compiled(torch.ones(step + 1))  # a new shape every step: a recompilation after the first
        meter.forward_end()
        clock.now += 2.0
        meter.backward_end()
        clock.now += 1.0
        meter.batch_end(stepped=True)
        if step == 2:
            metrics = meter.compute()
            assert metrics["comm_exposed_frac"] == 1.0 / (2 * 4.0)  # 1 s over a window of 2 steps x 4 s
            assert metrics["compute_frac"] == 1.0 - 1.0 / 8.0
            assert metrics["recompiles"] == 2  # 3 compilations since the meter's reset, the last two recompilations
            assert warnings == [] and "straggler_rank" not in metrics  # 2 after the warm-up: not more than 2
    metrics = meter.compute(final=True)
    assert metrics["recompiles"] == 4
    assert len(warnings) == 1 and "recompiled 4 times after the warm-up (more than max_recompiles=2)" in warnings[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"straggler_threshold": 0}, ValueError, r"straggler_threshold=0\): expected a finite number > 0"),
        ({"straggler_threshold": "high"}, TypeError, r"straggler_threshold='high'\)"),
        ({"straggler_windows": 0}, ValueError, r"straggler_windows=0\): expected an int >= 1"),
        ({"max_recompiles": -1}, ValueError, r"max_recompiles=-1\): expected an int >= 0"),
        ({"peak_flops": {"bf16": -1.0}}, ValueError, r"peak_flops\['bf16'\]=-1.0\): expected a finite number > 0"),
        ({"peak_flops": {}}, TypeError, r"peak_flops=\{\}\): expected dtype keys such as 'bf16'"),
        ({"peak_flops": {1: 2.0}}, TypeError, r"peak_flops=\{1: 2.0\}\)"),
    ],
)
@pytest.mark.parametrize("owner", [EfficiencyMeter, EfficiencyMonitor])
def test_bad_new_arguments_are_rejected_with_the_fix(owner, kwargs, error, match):
    with pytest.raises(error, match=rf"{owner.__name__}\(" + match + r".*Fix"):
        owner(**kwargs)
