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

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["efficiency_figure", "loss_scale_figure", "memory_figure", "plots_available", "save_png"]

Rows = Sequence[dict[str, Any]]

# (history key, label) of the memory kinds, in the memory table's order.
_MEMORY_KINDS = (
    ("params_mb", "parameters"),
    ("grads_mb", "gradients"),
    ("optimizer_mb", "optimizer state"),
    ("activations_mb", "activations"),
    ("param_casts_mb", "autocast weight copies"),
    ("peak_allocated_mb", "peak allocated (CUDA)"),
    ("peak_reserved_mb", "peak reserved (CUDA)"),
)


_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}  # beside the axes, off the data


def plots_available() -> bool:
    """Whether matplotlib can be imported (``pip install 'lit-accel[plots]'``)."""
    return importlib.util.find_spec("matplotlib") is not None


def _figure(rows: int, title: str) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.0, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0])
    figure.suptitle(title)
    axes[-1].set_xlabel("optimizer step")
    return figure, axes


def _series(rows: Rows, key: str) -> tuple[list[float], list[float]]:
    """The steps and values of the rows that hold ``key``."""
    kept = [r for r in rows if r.get(key) is not None]
    return [float(r["step"]) for r in kept], [float(r[key]) for r in kept]


def efficiency_figure(windows: Rows, title: str) -> Figure:
    """Throughput, and each window's step time split into compute, exposed communication and data wait (ms)."""
    figure, (throughput, breakdown) = _figure(2, title)
    throughput.plot(*_series(windows, "samples_per_sec"), marker=".", label="samples/s (global)")
    throughput.set_title("throughput")
    throughput.set_ylabel("samples/s")
    throughput.legend(**_LEGEND)
    kept = [w for w in windows if w.get("step_time_ms") is not None]
    steps = [float(w["step"]) for w in kept]
    step_ms = [float(w["step_time_ms"]) for w in kept]
    data = [ms * float(w.get("data_wait_frac", 0.0)) for ms, w in zip(step_ms, kept)]
    exposed = [ms * float(w.get("comm_exposed_frac", 0.0)) for ms, w in zip(step_ms, kept)]
    compute = [max(0.0, ms - d - e) for ms, d, e in zip(step_ms, data, exposed)]
    breakdown.stackplot(steps, compute, exposed, data, labels=["compute", "exposed comm", "data wait"], alpha=0.8)
    breakdown.set_title("step time breakdown")
    breakdown.set_ylabel("ms per step")
    breakdown.legend(**_LEGEND)
    return figure


def loss_scale_figure(history: Rows, title: str) -> Figure:
    """The fp16 loss scale (log scale) and the cumulative skipped steps at each logging step."""
    figure, (scale, skipped) = _figure(2, title)
    scale.plot(*_series(history, "loss_scale"), marker=".", label="loss scale")
    scale.set_yscale("log", base=2)
    scale.set_title("loss scale")
    scale.legend(**_LEGEND)
    skipped.step(*_series(history, "skipped_steps"), where="post", label="skipped steps (cumulative)")
    skipped.set_title("skipped steps")
    skipped.legend(**_LEGEND)
    return figure


def memory_figure(history: Rows, title: str) -> Figure:
    """Each memory kind the meter measured (MB, the largest rank's) at each logging step."""
    figure, (axes,) = _figure(1, title)
    for key, label in _MEMORY_KINDS:
        steps, values = _series(history, key)
        if steps and any(values):
            axes.plot(steps, values, marker=".", label=label)
    axes.set_title("memory by kind (largest rank)")
    axes.set_ylabel("MB")
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
