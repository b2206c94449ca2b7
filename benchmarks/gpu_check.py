"""The CUDA acceptance check of lit_accel: one prepared command per part, each well under 8 minutes on one H200.

The checks, each a row (or a few) of the table printed last, in two parts (``--checks part1`` / ``part2``):

part1
1. ``loss_scaling``: ``AccelPrecision("16-mixed", scaler=DynamicGradScaler(growth_interval=4))`` trains a small MLP
   for 24 steps with an overflow injected at step 6, with ``AdamW`` and ``AdamW(fused=True)``: exactly that step is
   skipped, the weights are bit-identical across it, scale/growths/back-offs equal a simulation of torch's rule,
   ``LossScaleMonitor`` reports the same, the loss falls; a 2**-30 gradient flushes to zero unscaled and is recovered.
2. ``syncs``: lit_accel (``AccelDDP`` + ``AccelPrecision`` + ``LossScaleMonitor`` + ``EfficiencyMonitor``) adds 0
   host-device syncs per steady-state step to plain Lightning with ``AdamW(fused=True)`` in ``16-mixed`` and
   ``bf16-mixed`` with ``NonFiniteGuard`` (``torch.cuda.set_sync_debug_mode("warn")``, host reads and
   ``synchronize`` calls counted); a non-fused positive control must show the 1 documented sync.
3. ``vit``: ViT-B/16 images/s and MFU in fp32 (TF32 off; Lightning's plugin), bf16-mixed and 16-mixed at
   ``--batch`` (halved on out-of-memory); mixed precision must beat fp32.
4. ``syncbn`` (``_gpu_checks_syncbn.py``): torch's and lit_accel's SyncBatchNorm equal BatchNorm on the joint batch
   (torch's with its 5 fused kernels), their step time and host syncs, and ``"auto"``'s choice against the faster.
5. ``memory``: MemoryMonitor's activations + autocast's weight copies within 25% of ``memory_allocated``'s growth
   over the forward (bf16, 32 images), and its peak is the fit's own (the process peaked at 8 GiB just before).
6. ``micro_batch_auto``: ``micro_batch_size="auto"`` under ``set_per_process_memory_fraction`` (256 and 128 do not
   fit, 64 does): a smaller micro-batch is chosen before the first step and the fit finishes, with AccelDDP and
   AccelFSDP.

part2 (ViT-B/16 at ``min(--batch, 128)``, 3 warm-up and 10 timed steps, fused AdamW; fits shared, ``_gpu_arms.py``)
7. ``fsdp``: ``AccelFSDP()`` on one GPU, bf16: the loss falls at least half as much as AccelDDP's; images/s as INFO.
8. ``compile``: ``AccelDDP(compile=True)`` (inductor per block) must not be slower than eager, first 3 losses equal
   within 4 bf16 rounding units.
9. ``fp8`` (``_gpu_checks_fp8.py``): ``"fp8-mixed"`` converts on FP8 tensor cores (capability >= 8.9) with finite
   losses; compiled FP8 must beat compiled bf16 on a model wide enough for FP8 to pay off (ViT-B/16 eager as INFO);
   and a ViT batch of 3 (591 rows) trains, which ``torch._scaled_mm`` takes only padded.
10. ``parallel`` (``_gpu_checks_parallel.py``): AccelParallel's pipeline parts on one GPU: a stage under compile and
    FP8 trains with finite losses close to eager bf16's, and the bubble meter times on CUDA events.

``--dry-run`` runs the same code on CPU with tiny shapes (gloo, host-read counts, ``aot_eager``, emulated FP8, no
allocator); what only a GPU can judge is INFO. Results are written to ``--out`` (JSON and a markdown table) after
each check, so a run cut short keeps what finished. Exit code 1 when a check fails.

Run from the repository root; nothing needs installing but torchao (``benchmarks/prepare_gpu_run.sh``), and the
exact commands for the lent GPU machine are in ``benchmarks/README.md``::

    PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --checks part1 --out /tmp/gpu_check_part1.json
    PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check_dry.json   # CPU, a few minutes

To add checks: a module ``benchmarks/_gpu_checks_<topic>.py`` with ``CHECKS = {name: check}`` (``check(ctx) ->
(rows, data)``, rows from ``_gpu_arms.row``), its name in ``CHECK_MODULES`` and its checks in a part of ``PARTS``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if importlib.util.find_spec("lit_accel") is None:  # run from a checkout without installing: the repository root
    _ROOT = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

import _common
import torch
from _gpu_arms import Check, Row, row

#: The modules whose ``CHECKS`` make up the script, in running order.
CHECK_MODULES = (
    "_gpu_checks_precision",
    "_gpu_checks_vit",
    "_gpu_checks_syncbn",
    "_gpu_checks_training",
    "_gpu_checks_fp8",
    "_gpu_checks_parallel",
)
#: Two calls of the lent machine, each well under 8 minutes on an H200 (estimates in benchmarks/README.md).
PARTS = {
    "part1": ("loss_scaling", "syncs", "vit", "syncbn", "memory", "micro_batch_auto"),
    "part2": ("fsdp", "compile", "fp8", "parallel"),
}


def all_checks() -> dict[str, Check]:
    checks: dict[str, Check] = {}
    for name in CHECK_MODULES:
        checks.update(importlib.import_module(name).CHECKS)
    return checks


def select(spec: str, checks: dict[str, Check]) -> list[str]:
    """Check names from ``--checks``: part names and check names, comma-separated, in the order given."""
    chosen: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        for name in PARTS.get(item, (item,)) if item else ():
            if name not in checks:
                raise ValueError(f"--checks {spec}: unknown {name!r}; expected {', '.join([*PARTS, *checks])}")
            if name not in chosen:
                chosen.append(name)
    if not chosen:
        raise ValueError(f"--checks {spec!r} names no check")
    return chosen


def _print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "INFO": "cyan", "n/a": "yellow"}
    for line in rows:
        table.add_row(line["check"], f"[{colors.get(line['result'], 'white')}]{line['result']}[/]", line["detail"])
    Console(width=160).print(table)


def _save(result: dict[str, Any], out: Path) -> str:
    """Write the JSON and the markdown table now (a run cut at its time limit keeps every finished check)."""
    import json

    table = _common.markdown_table(
        ["check", "result", "detail"], [[r["check"], r["result"], r["detail"]] for r in result["rows"]]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"<!-- written by: {result['command']} -->\n\n{table}")
    return table


def _context(args: Any) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if not args.dry_run else torch.device("cpu")
    return {
        "cuda": not args.dry_run,
        "dry_run": args.dry_run,
        "device": device,
        "batch": 4 if args.dry_run else args.batch,
        "peak": args.peak_tflops * 1e12 if args.peak_tflops else None,
    }


def main(argv: list[str] | None = None) -> int:
    checks = all_checks()
    p = _common.parser("gpu_check", __doc__)
    p.add_argument("--dry-run", action="store_true", help="run on CPU with tiny shapes (no CUDA needed)")
    p.add_argument("--batch", type=_common.positive_int, default=512, help="ViT-B/16 batch to start from")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s for MFU (default: table)")
    p.add_argument(
        "--checks", default=",".join(PARTS), help=f"parts ({', '.join(PARTS)}) or checks ({', '.join(checks)})"
    )
    args = p.parse_args(argv)
    try:
        names = select(args.checks, checks)
    except ValueError as err:
        p.error(str(err))
    if not args.dry_run and not torch.cuda.is_available():
        p.error("CUDA is not available: run with --dry-run to exercise the script on CPU")
    _common.quiet()
    ctx = _context(args)
    machine = _common.machine_info()
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "command": _common.command_line("gpu_check.py", argv),
        "mode": "dry-run (CPU)" if args.dry_run else "cuda",
        "machine": {**machine, "torch": torch.__version__},
        "checks": names,
        "seconds_per_check": {},
        "rows": [],
        "details": {},
        "complete": False,
    }
    for name in names:
        start = time.perf_counter()
        try:
            new_rows, result["details"][name] = checks[name](ctx)
        except Exception as exc:  # a broken check must not hide the others' results
            new_rows = [row(name, "FAIL", f"{type(exc).__name__}: {exc}"[:300])]
            result["details"][name] = {"error": traceback.format_exc()}
        result["rows"] += new_rows
        result["seconds_per_check"][name] = round(time.perf_counter() - start, 1)
        result["passed"] = not any(r["result"] == "FAIL" for r in result["rows"])
        _save(result, args.out)
    result["complete"] = True
    table = _save(result, args.out)
    print(table, file=sys.stderr)
    failed = [r for r in result["rows"] if r["result"] == "FAIL"]
    title = f"lit_accel gpu_check ({result['mode']}, {machine.get('gpu', machine['cpu'])}, torch {torch.__version__}): "
    title += "all passed" if not failed else f"{len(failed)} FAILED"
    _print_table(result["rows"], title + f" in {sum(result['seconds_per_check'].values()):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
