"""``micro_batch_size="auto"`` under a sweep of real memory caps, AccelDDP and AccelFSDP (issue #47).

Each run is ``tests/scripts/micro_batch_oom.py``: 2 gloo processes, each capping its own address space
(``RLIMIT_AS``) when training starts at its size then plus a budget; a model whose activations grow with the
micro-batch (``--model wide``: ``Linear(8, 131072)``, ReLU, ``Linear(131072, 4)``, 32 samples loaded per device, four
optimizer steps). First the footprint of every fixed micro-batch (1 to 32) is measured uncapped: the largest growth of
the address space over the fit. The caps are then set from them: uncapped, halfway between two neighbouring sizes'
footprints, below the smallest footprint, and 6 MB. Under each cap, per strategy, ``"auto"`` runs, and, where it
trains, the size it chose runs fixed under the same cap: the figures are the outcome (trained with N, or the line it
stopped with), whether the chosen size is the largest whose footprint fits, and the time ``trainer.fit`` took with
``"auto"`` against the fixed size (the search's cost; one run each, so only a rough figure).

Run (from the repository root, about 8 minutes on 2 cores; one multi-process job at a time)::

    python benchmarks/micro_batch_auto.py      # writes benchmarks/results/micro_batch_auto.json (+ .md)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "micro_batch_oom.py"
SIZES = (1, 2, 4, 8, 16, 32)
UNCAPPED = 1e6  # MB
CHOSE = re.compile(r"micro_batch_size='auto' chose (\d+)")
STOP = re.compile(r"(AccelDDP|AccelFSDP)[:(].*(?:Fix: .*|does not fit.*)|.*can't allocate memory.*")


def _run(tmp: Path, strategy: str, budget_mb: float, micro: str) -> dict[str, Any]:
    out = tmp / f"{strategy}-{budget_mb}-{micro}.pt"
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--budget-mb", str(budget_mb), "--micro", micro, "--out", str(out),
           "--strategy", strategy]  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"outcome": "hung (killed after 300 s)"}
    if done.returncode == 0:
        result = torch.load(out, weights_only=True)
        return {"outcome": "trained", "micro": result["micro"], "footprint_mb": result["footprint"] / 1e6,
                "fit_s": result["fit_s"]}  # fmt: skip
    lines = [m.group(0).split("]: ")[-1][:200] for m in STOP.finditer(done.stderr)]
    chose = CHOSE.search(done.stdout + done.stderr)  # a choice announced, then a failure: what must never happen
    return {"outcome": "stopped", "message": lines[-1] if lines else done.stderr.strip().splitlines()[-1][:200],
            "both_ranks": "[rank0]" in done.stderr and "[rank1]" in done.stderr,
            "died_after_choosing": None if chose is None else int(chose.group(1))}  # fmt: skip


def _caps(footprints: dict[int, float]) -> list[tuple[str, float]]:
    caps = [("uncapped", UNCAPPED)]
    for small, large in itertools.pairwise(SIZES):
        caps.append((f"between {small} and {large}", round((footprints[small] + footprints[large]) / 2, 1)))
    caps.append(("below 1", round(footprints[1] * 0.8, 1)))
    caps.append(("6 MB", 6.0))
    return caps


def _sweep(strategy: str, tmp: Path) -> dict[str, Any]:
    footprints = {size: _run(tmp, strategy, UNCAPPED, str(size))["footprint_mb"] for size in SIZES}
    rows = []
    for label, budget in _caps(footprints):
        auto = _run(tmp, strategy, budget, "auto")
        row = {"cap": label, "budget_mb": budget, "auto": auto}
        fitting = [size for size in SIZES if footprints[size] <= budget]
        row["largest_fitting"] = max(fitting) if fitting else None
        if auto["outcome"] == "trained":
            row["fixed"] = _run(tmp, strategy, budget, str(auto["micro"]))
            if row["fixed"]["outcome"] == "trained":
                row["search_s"] = auto["fit_s"] - row["fixed"]["fit_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"footprints_mb": footprints, "rows": rows}


def _markdown(results: dict[str, Any], command: str) -> str:
    lines = [f"<!-- written by: {command} -->", "", "Footprints (MB, fixed micro-batch, uncapped):", ""]
    lines += ["| strategy | " + " | ".join(str(s) for s in SIZES) + " |", "| --- |" + " --- |" * len(SIZES)]
    for strategy, result in results.items():
        fp = result["footprints_mb"]
        lines.append(f"| {strategy} | " + " | ".join(f"{fp[s]:.1f}" for s in SIZES) + " |")
    lines += ["", "| strategy | cap | budget (MB) | largest fitting | auto | fixed at its choice | search (s) |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for strategy, result in results.items():
        for row in result["rows"]:
            auto = row["auto"]
            outcome = (f"trained with {auto['micro']} ({auto['fit_s']:.1f} s)" if auto["outcome"] == "trained"
                       else f"{auto['outcome']}: `{auto.get('message', '')}`")  # fmt: skip
            if auto.get("died_after_choosing") is not None:
                outcome += f" (after choosing {auto['died_after_choosing']})"
            fixed = row.get("fixed", {})
            fixed_text = (
                f"trained ({fixed['fit_s']:.1f} s)" if fixed.get("outcome") == "trained" else fixed.get("outcome", "")
            )
            search = f"{row['search_s']:+.1f}" if "search_s" in row else ""
            budget = "none" if row["budget_mb"] >= UNCAPPED else f"{row['budget_mb']:.1f}"
            lines.append(f"| {strategy} | {row['cap']} | {budget} | {row['largest_fitting'] or 'none'} | {outcome} |"
                         f" {fixed_text} | {search} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "micro_batch_auto.json")
    parser.add_argument("--strategies", default="ddp,fsdp")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            results[strategy] = _sweep(strategy, Path(tmp))
    args.out.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=1) + "\n")
    command = "python benchmarks/micro_batch_auto.py" + ("" if args.strategies == "ddp,fsdp" else
                                                         f" --strategies {args.strategies}")  # fmt: skip
    args.out.with_suffix(".md").write_text(_markdown(results, command))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
