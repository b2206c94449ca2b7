"""The monitors' end-of-fit pictures: one PNG next to each JSON report, drawn with matplotlib (optional: ``[plots]``).

Figures are built with ``matplotlib.figure.Figure`` and its Agg canvas, never ``pyplot``: no global state, no GUI
backend, safe in any process. Each ``*_figure`` function takes what its meter already keeps (the windows or the logged
history, ``{"step": ..., key: value}`` rows) and returns the figure, so tests read its series from the axes; the
monitors hand it to :func:`save_png`, which says once, without an error, when matplotlib is missing.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_accel.utilities._units import scale_for_axis

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["efficiency_figure", "loss_scale_figure", "memory_figure", "plots_available", "save_png", "save_report"]

Rows = Sequence[dict[str, Any]]

# (history key, label, colour, line style) of the memory kinds, in the memory table's order. Colours are fixed per
# kind, so two runs' pictures compare at a glance; parameters and gradients are often the same size, so the gradients
# are dashed over a wide, pale parameters line and both stay visible.
_MEMORY_KINDS = (
    ("params_mb", "parameters", "tab:blue", {"linewidth": 4.0, "alpha": 0.45}),
    ("grads_mb", "gradients", "tab:orange", {"linestyle": "--"}),
    ("optimizer_mb", "optimizer state", "tab:green", {}),
    ("activations_mb", "activations", "tab:red", {}),
    ("param_casts_mb", "autocast weight copies", "tab:purple", {"linestyle": ":"}),
    ("peak_allocated_mb", "peak allocated (CUDA)", "tab:brown", {}),
    ("peak_reserved_mb", "peak reserved (CUDA)", "tab:gray", {"linestyle": "-."}),
)
# The step-time breakdown's parts: (label, colour).
_BREAKDOWN = {"compute": "tab:blue", "exposed comm": "tab:red", "data wait": "tab:olive"}


_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}  # beside the axes, off the data


def plots_available() -> bool:
    """Whether matplotlib can be imported (``pip install 'lit-accel[plots]'``)."""
    return importlib.util.find_spec("matplotlib") is not None


def _figure(rows: int, title: str) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9.0, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0])
    figure.suptitle(title)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 9.25
    return figure, axes


def _series(rows: Rows, key: str) -> tuple[list[float], list[float]]:
    """The steps and values of the rows that hold ``key``."""
    kept = [r for r in rows if r.get(key) is not None]
    return [float(r["step"]) for r in kept], [float(r[key]) for r in kept]


def _from_zero(axes: Axes) -> None:
    """Start the value axis at 0: a throughput or a size is read against zero, not against its own minimum."""
    axes.set_ylim(bottom=0.0)


def _step_parts(windows: Rows, step_s: list[float]) -> dict[str, list[float]]:
    """Each window's step seconds split into data wait, exposed communication (where measured) and compute."""
    parts = {"data wait": [s * float(w.get("data_wait_frac", 0.0)) for s, w in zip(step_s, windows)]}
    if any(w.get("comm_exposed_frac") is not None for w in windows):
        parts["exposed comm"] = [s * float(w.get("comm_exposed_frac", 0.0)) for s, w in zip(step_s, windows)]
    parts["compute"] = [max(0.0, s - sum(p[i] for p in parts.values())) for i, s in enumerate(step_s)]
    return parts


def efficiency_figure(windows: Rows, title: str) -> Figure:
    """Throughput, and each window's step time split into compute, exposed communication and data wait.

    The exposed-communication band is drawn only when the strategy measured it (no empty legend entry on one process
    or under a strategy without comm figures); the time unit follows the longest step.
    """
    figure, (throughput, breakdown) = _figure(2, title)
    throughput.plot(*_series(windows, "samples_per_sec"), marker=".", color="tab:blue", label="samples/s (global)")
    throughput.set_title("throughput")
    throughput.set_ylabel("samples/s")
    _from_zero(throughput)
    throughput.legend(**_LEGEND)
    kept = [w for w in windows if w.get("step_time_ms") is not None]
    steps = [float(w["step"]) for w in kept]
    step_s = [float(w["step_time_ms"]) / 1e3 for w in kept]
    scale, unit = scale_for_axis(max(step_s, default=0.0), "s")
    parts = _step_parts(kept, step_s)
    order = [name for name in _BREAKDOWN if name in parts]  # compute at the bottom, data wait on top
    breakdown.stackplot(
        steps,
        *([v / scale for v in parts[name]] for name in order),
        labels=order,
        colors=[_BREAKDOWN[name] for name in order],
        alpha=0.8,
    )
    breakdown.set_title("step time breakdown")
    breakdown.set_ylabel(f"{unit} per step")
    _from_zero(breakdown)
    breakdown.legend(**_LEGEND)
    return figure


def loss_scale_figure(history: Rows, title: str) -> Figure:
    """The fp16 loss scale (log scale) and the cumulative skipped steps at each logging step."""
    figure, (scale, skipped) = _figure(2, title)
    scale.plot(*_series(history, "loss_scale"), marker=".", color="tab:blue", label="loss scale")
    scale.set_yscale("log", base=2)
    scale.set_title("loss scale")
    scale.legend(**_LEGEND)
    steps, counts = _series(history, "skipped_steps")
    skipped.step(steps, counts, where="post", color="tab:red", label="skipped steps (cumulative)")
    skipped.set_title("skipped steps")
    skipped.set_ylim(0.0, max([1.0, *counts]) * 1.05)  # from 0; a run with no skip shows a flat line at 0
    skipped.legend(**_LEGEND)
    return figure


def memory_figure(history: Rows, title: str, world_size: int = 1) -> Figure:
    """Each memory kind the meter measured (the largest rank's, with several) at each logging step.

    Kinds that are zero throughout are left out; the unit (B, kB, MB, GB) follows the largest value.
    """
    figure, (axes,) = _figure(1, title)
    drawn = [kind for kind in _MEMORY_KINDS if any(_series(history, kind[0])[1])]
    largest = max((max(_series(history, key)[1]) for key, *_ in drawn), default=0.0) * 1e6  # the keys are in MB
    scale, unit = scale_for_axis(largest, "B")
    for key, label, colour, style in drawn:
        steps, values = _series(history, key)
        axes.plot(steps, [v * 1e6 / scale for v in values], marker=".", color=colour, label=label, **style)
    axes.set_title("memory by kind" + (f" (largest of {world_size} ranks)" if world_size > 1 else ""))
    axes.set_ylabel(unit)
    _from_zero(axes)
    axes.legend(**_LEGEND)
    return figure


def save_png(make: Callable[[], Figure], path: Path, owner: str, info: Callable[[str], Any]) -> Path | None:
    """Draw ``make()`` into ``path``; without matplotlib tell ``info`` once per call and write nothing."""
    if not plots_available():
        info(f"{owner}: matplotlib is not installed, so no {path.name}. Fix: pip install 'lit-accel[plots]'.")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    make().savefig(path, dpi=100)
    return path


def save_report(
    path: Path, report: Mapping[str, Any], make: Callable[[], Figure], owner: str, info: Callable[[str], Any]
) -> None:
    """Write ``report`` as JSON at ``path`` and its figure beside it (same name, ``.png``), as every monitor does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    save_png(make, path.with_suffix(".png"), owner, info)
