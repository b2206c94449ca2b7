"""Eager against compiled step time of the CIFAR-sized ViT under AccelDDP on CPU, in one run.

``AccelDDP(compile=True)`` compiles each ViT ``Block``'s forward (inductor) before DDP wraps the model. This runs
``overhead.py``'s ``lit_accel`` and ``lit_accel_compiled`` arms (2 gloo processes, bf16 autocast, AdamW, the
monitors on) in interleaved repetitions; the first steps of every fit, where compilation happens, are not timed
(``--warmup``, 8 by default). The ratio is ``lit_accel_compiled / lit_accel`` (below 1: compile is faster). What a
CPU gives says little about a GPU: ``benchmarks/gpu_check.py`` measures that.

Run (from the repository root)::

    python benchmarks/compile.py                   # writes benchmarks/results/compile.json (+ .md)
    python benchmarks/compile.py --tiny            # checks that it runs
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import _common
import overhead


def main(argv: list[str] | None = None) -> dict[str, Any]:
    given = list(sys.argv[1:] if argv is None else argv)
    argv = list(given)
    if "--out" not in argv:
        argv += ["--out", str(_common.RESULTS_DIR / "compile.json")]
    if "--warmup" not in argv and "--tiny" not in argv:
        argv += ["--warmup", "8"]
    if "--reps" not in argv and "--tiny" not in argv:
        argv += ["--reps", "4"]
    result = overhead.main(["--arms", "lit_accel,lit_accel_compiled", *argv])
    ratio = result["ratios"]["lit_accel_compiled/lit_accel"]["median_step"]["median"]
    # overhead.py wrote the run as its own; name it as this script's, with the ratio this script is for.
    result.update(benchmark="compile", command=_common.command_line("compile.py", given), compiled_over_eager=ratio)
    out = Path(argv[argv.index("--out") + 1])
    table = out.with_suffix(".md").read_text().split("\n", 2)[2]  # without overhead.py's header line
    _common.write_outputs(result, out, table + f"\ncompiled / eager median step: {ratio:.3f}\n")
    return result


if __name__ == "__main__":
    main()
