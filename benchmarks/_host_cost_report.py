"""The report of ``host_cost.py``: the issue's limits, the acceptance verdicts and the markdown tables.

Split from ``host_cost.py`` (which measures): pure functions of its result dictionary.
"""

from __future__ import annotations

from typing import Any

import _common

#: The issue's acceptance: (arm, baseline, most ms of CPU per step it may add).
LIMITS = (("accel_fp16", "ddp_fp16", 0.10), ("full", "ddp_fp16", 0.25), ("accel_ddp", "ddp", 0.05))


def acceptance(differences: dict[str, Any]) -> list[dict[str, Any]]:
    """Each limit of :data:`LIMITS` whose pair was measured: the median added, its IQR, and whether it is met."""
    out = []
    for arm, ref, limit in LIMITS:
        d = differences.get(f"{arm} - {ref}")
        if d is not None:
            added = d["cpu_ms"]
            out.append({"arm": arm, "baseline": ref, "limit_ms": limit, "added_cpu_ms": added["median"],
                        "iqr_ms": added["iqr"], "met": added["median"] <= limit})  # fmt: skip
    return out


def row(name: str, values: tuple[float, float, float]) -> dict[str, Any]:
    """A profiled function's extra calls, own and cumulative microseconds per step, rounded for the JSON."""
    return {"function": name, "extra_calls_per_step": round(values[0], 2), "extra_own_us": round(values[1], 1),
            "cumulative_us": round(values[2], 1)}  # fmt: skip


def span(s: dict[str, float]) -> str:
    """An IQR as text."""
    return f"{s['q1']:+.3f} .. {s['q3']:+.3f}"


def tables(result: dict[str, Any]) -> str:
    """The markdown written next to the JSON: per world size the pairs and the acceptance, then the profiles."""
    text = f"Measured {result['machine']['date_utc']} UTC, load average {result['machine']['load_average_1_5_15_min']}"
    text += f" -> {result['load_average_after']} ({result['note']}).\n"
    for world_size, run in result.get("world_sizes", {}).items():
        text += f"\n**{world_size} process(es)**: ms per optimizer step, median over repetitions (IQR).\n\n"
        if "arms" in run:  # --design sequential
            rows = [[arm, f"{a['cpu_ms']['median']:.3f}", f"{a['cpu_ms']['iqr']:.3f}", f"{a['wall_ms']['median']:.3f}",
                     f"{a['wall_ms']['iqr']:.3f}"] for arm, a in run["arms"].items()]  # fmt: skip
            text += _common.markdown_table(["arm", "CPU", "IQR", "wall", "IQR"], rows) + "\n"
            rows = [[name, f"{d['cpu_ms']['median']:+.3f}", span(d["cpu_ms"]), f"{d['wall_ms']['median']:+.3f}",
                     span(d["wall_ms"])] for name, d in run["differences"].items()]  # fmt: skip
            text += _common.markdown_table(["difference", "CPU", "IQR", "wall", "IQR"], rows) + "\n"
        else:
            rows = [[name, f"{d['cpu_ms']['median']:+.4f}", span(d["cpu_ms"]), f"{d['arm_cpu_ms']['median']:.3f}",
                     f"{d['ref_cpu_ms']['median']:.3f}"] for name, d in run["differences"].items()]  # fmt: skip
            header = ["pair (run in turns)", "CPU added", "IQR", "arm CPU", "reference CPU"]
            text += _common.markdown_table(header, rows) + "\n"
        rows = [[f"{a['arm']} - {a['baseline']}", f"<= {a['limit_ms']:.2f}", f"{a['added_cpu_ms']:+.3f}",
                 f"{a['iqr_ms']:.3f}", "yes" if a["met"] else "no"] for a in run["acceptance"]]  # fmt: skip
        text += _common.markdown_table(["acceptance", "limit (ms CPU)", "added", "IQR", "met"], rows)
    for arm, p in result.get("profile", {}).items():
        text += f"\n**profile {arm}**: {p['python_calls_per_step']} Python calls, {p['aten_ops_per_step']} ATen ops"
        text += f" per step; over its baseline {p.get('extra_python_calls_per_step', 0):+} calls,"
        text += f" ops {p.get('extra_aten_ops', {})}\n"
        rows = [[r["function"], r["extra_calls_per_step"], r["extra_own_us"], r["cumulative_us"]]
                for r in p.get("lit_accel_cumulative", [])]  # fmt: skip
        if rows:
            text += "\n" + _common.markdown_table(["lit_accel function", "extra calls/step", "own us", "cum us"], rows)
    return text
