"""The monitors' pictures: each figure shows the named series, and a fit with the monitors writes the PNGs."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins import MixedPrecision

from lit_accel import EfficiencyMonitor, LossScaleMonitor, MemoryMonitor
from lit_accel.meters import plots
from lit_accel.meters.plots import efficiency_figure, loss_scale_figure, memory_figure
from tests.helpers import BNModel, lightning_info_messages, make_dataset, make_loader, small_trainer_kwargs


def _labels(axes) -> list[str]:
    """The legend labels of an axes: its lines and its filled areas (a stack plot's)."""
    return [a.get_label() for a in [*axes.get_lines(), *axes.collections] if not a.get_label().startswith("_")]


def test_the_efficiency_figure_shows_throughput_and_the_step_time_breakdown():
    windows = [
        {"step": 4, "samples_per_sec": 100.0, "step_time_ms": 40.0, "data_wait_frac": 0.25, "comm_exposed_frac": 0.5},
        {"step": 9, "samples_per_sec": 120.0, "step_time_ms": 30.0, "data_wait_frac": 0.1},  # no exposed comm known
    ]
    throughput, breakdown = efficiency_figure(windows, "run").axes
    assert (throughput.get_title(), breakdown.get_title()) == ("throughput", "step time breakdown")
    assert _labels(throughput) == ["samples/s (global)"]
    assert list(throughput.get_lines()[0].get_ydata()) == [100.0, 120.0]
    assert _labels(breakdown) == ["compute", "exposed comm", "data wait"]
    # The stack's top is the step time: compute 10 + exposed 20 + data 10 = 40 ms, then 27 + 0 + 3 = 30 ms.
    top = breakdown.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(40.0)


def test_the_loss_scale_and_memory_figures_show_their_series():
    history = [
        {"step": 1, "loss_scale": 1024.0, "skipped_steps": 0},
        {"step": 3, "loss_scale": 512.0, "skipped_steps": 1},
    ]
    scale, skipped = loss_scale_figure(history, "amp").axes
    assert _labels(scale) == ["loss scale"] and scale.get_yscale() == "log"
    assert _labels(skipped) == ["skipped steps (cumulative)"]
    memory = [{"step": 1, "params_mb": 1.0, "grads_mb": 1.0, "optimizer_mb": 2.0, "activations_mb": 3.0,
               "param_casts_mb": 0.0}]  # fmt: skip
    (axes,) = memory_figure(memory, "mem", world_size=2).axes
    assert axes.get_title() == "memory by kind (largest of 2 ranks)"
    assert _labels(axes) == ["parameters", "gradients", "optimizer state", "activations"]  # no autocast: no casts
    (one,) = memory_figure(memory, "mem").axes
    assert one.get_title() == "memory by kind"  # one rank: no "largest" to speak of


def test_the_efficiency_figure_starts_at_zero_and_draws_no_comm_band_without_comm_figures():
    # One process (or a strategy without comm figures): no exposed-comm key in any window.
    windows = [{"step": 4, "samples_per_sec": 900.0, "step_time_ms": 2500.0, "data_wait_frac": 0.2},
               {"step": 9, "samples_per_sec": 1000.0, "step_time_ms": 2000.0, "data_wait_frac": 0.1}]  # fmt: skip
    throughput, breakdown = efficiency_figure(windows, "run").axes
    assert _labels(breakdown) == ["compute", "data wait"]
    assert throughput.get_ylim()[0] == 0.0 and breakdown.get_ylim()[0] == 0.0
    assert breakdown.get_ylabel() == "s per step"  # 2.5 s steps read in seconds, not 2500 ms
    assert breakdown.collections[-1].get_paths()[0].vertices[:, 1].max() == pytest.approx(2.5)


def _lines(axes) -> dict:
    return {line.get_label(): line for line in axes.get_lines()}


def test_the_memory_figure_picks_its_unit_starts_at_zero_and_keeps_each_kinds_colour():
    small = [{"step": s, "params_mb": 0.006, "grads_mb": 0.006, "optimizer_mb": 0.012, "activations_mb": 0.002}
             for s in (1, 3)]  # fmt: skip
    (axes,) = memory_figure(small, "mem").axes
    assert axes.get_ylabel() == "kB" and axes.get_ylim()[0] == 0.0
    lines = _lines(axes)
    assert list(lines["parameters"].get_ydata()) == pytest.approx([6.0, 6.0])  # 0.006 MB = 6 kB
    # parameters and gradients of equal size: different styles, so neither hides the other
    assert lines["parameters"].get_linestyle() != lines["gradients"].get_linestyle()
    # colours are fixed per kind, whatever else the picture shows
    (other,) = memory_figure([{"step": 1, "params_mb": 2e3, "activations_mb": 5e3}], "mem").axes
    assert other.get_ylabel() == "GB"
    for label in ("parameters", "activations"):
        assert _lines(other)[label].get_color() == lines[label].get_color()
    assert lines["parameters"].get_color() != lines["activations"].get_color()


def _fit_with_the_three_monitors(tmp_path) -> dict:
    monitors = {
        "perf": EfficiencyMonitor(warmup_steps=1, report_path=tmp_path / "perf.json", print_summary=False),
        "amp": LossScaleMonitor(report_path=tmp_path / "amp.json"),
        "mem": MemoryMonitor(report_path=tmp_path / "mem.json", print_summary=False),
    }
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            max_steps=6,
            log_every_n_steps=2,
            plugins=[MixedPrecision("16-mixed", "cpu")],
            callbacks=[*monitors.values()],
        )
    )
    trainer.fit(BNModel(), make_loader(make_dataset(32), 4))
    return monitors


def test_a_fit_with_the_monitors_writes_a_png_next_to_each_json_report(tmp_path):
    monitors = _fit_with_the_three_monitors(tmp_path)
    for name in ("perf", "amp", "mem"):
        assert json.loads((tmp_path / f"{name}.json").read_text())
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    amp = json.loads((tmp_path / "amp.json").read_text())
    assert [row["step"] for row in amp["history"]] == [1, 3, 5] and amp["history"] == monitors["amp"].history
    assert amp["summary"]["steps"] == 6


def test_without_matplotlib_each_monitor_says_so_once_and_writes_no_png(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "plots_available", lambda: False)
    with lightning_info_messages() as messages:
        _fit_with_the_three_monitors(tmp_path)
    said = [m for m in messages if "matplotlib is not installed" in m]
    assert len(said) == 3 and all("pip install 'lit-accel[plots]'" in m for m in said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["amp.json", "mem.json", "perf.json"]
