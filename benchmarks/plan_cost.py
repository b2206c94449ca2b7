"""What ``lit_accel.plan`` costs, and that it scales (issue #50): seconds and the process's peak memory per case.

* ``vit_example``: ``examples/vit.py``'s module as it trains on the digits (timm's ViT, width 96, depth 4, AdamW)
  with one loaded batch of 16 images (the default global batch 32 over 2 devices), every layout of 2 processes and
  of 8 (refused layouts included: the ViT example has no ``pipeline_loss``).
* ``gpt_7b``: a GPT-style model of 6.7e9 parameters (``tests/helpers/gpt.py`` at LLaMA-7B's sizes: 32 blocks, width
  4096, 32 heads, 32,000 tokens, 2,048 context) built on the meta device, with a batch of 8 sequences of 2,048 tokens,
  planned for 64 processes under bf16-mixed over every layout of the world (with and without checkpointing). Its
  ``ddp`` and ``fsdp`` parameters, gradients and AdamW state are checked against the closed form (numel x bytes /
  shards).

Each case runs in a fresh interpreter: its seconds are the ``plan()`` call's, its memory the peak resident set
(``ru_maxrss`` of the process or of the children its fake work runs in, whichever is larger) minus what the interpreter
held before the call (imports and the model), and that peak whole (the interpreter, torch and the model included).
Targets: under 60 s per case, under 2 GB for the 7B plan.

Run (from the repository root; about a minute on 2 cores)::

    python benchmarks/plan_cost.py       # writes benchmarks/results/plan_cost.json (+ .md)
    python benchmarks/plan_cost.py --tiny  # the smoke test's: small models, the same checks
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

import _common

sys.path.insert(0, str(_common.REPO_ROOT))  # tests/helpers: the GPT-style model; examples/: the ViT example

GPT_7B = {"depth": 32, "width": 4096, "heads": 32, "vocab": 32000, "context": 2048}
GPT_TINY = {"depth": 4, "width": 64, "heads": 4, "vocab": 128, "context": 32}


def _vit_example(world: int, tiny: bool) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from tests.examples._scripts import EXAMPLES, imported_example

    with imported_example(EXAMPLES / "vit.py", "vit_example") as vit:
        net = vit.build_model(vit.DIGITS_MODEL, 10, 1, 16)
        module = vit.ImageClassifier(net, 10, 2e-3, 0.05, None, input_shape=(1, 16, 16))
    loaded = vit.DIGITS_GLOBAL_BATCH // 2
    batch = (torch.zeros(loaded, 1, 16, 16), torch.zeros(loaded, dtype=torch.long))
    return module, batch, {"world_size": world, "precision": "32-true", "loaded_batch": loaded}


def _gpt(world: int, tiny: bool) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from tests.helpers.gpt import GPT

    sizes = GPT_TINY if tiny else GPT_7B
    with torch.device("meta"):
        module = GPT(**sizes)
    tokens = torch.zeros(8, sizes["context"], dtype=torch.long)
    return module, (tokens, tokens), {"world_size": world, "precision": "bf16-mixed", "loaded_batch": 8, **sizes}


CASES = {"vit_example-2": (_vit_example, 2), "vit_example-8": (_vit_example, 8), "gpt_7b-64": (_gpt, 64)}


def _case(name: str, tiny: bool) -> dict[str, Any]:
    """One case in this interpreter: the plan's seconds, its peak memory added, its rows, the closed-form check."""
    _common.quiet()
    from lit_accel import plan

    build, world = CASES[name]
    module, batch, config = build(world, tiny)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    start = time.perf_counter()
    planned = plan(module, batch, world_size=world, precision=config["precision"])
    seconds = time.perf_counter() - start
    # the plan's fake work runs in forked children: their peak (the parent's pages it shares included) counts too
    after = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    added = after * 1024 - before
    params = sum(p.numel() for p in module.parameters())
    out = {"case": name, **config, "params": params, "seconds": seconds, "peak_rss_added_mb": added / 1e6,
           "peak_rss_mb": after * 1024 / 1e6,
           "layouts": len(planned.rows), "refused": sum(row.refused is not None for row in planned.rows),
           "rows": json.loads(planned.to_json())["rows"]}  # fmt: skip
    if name.startswith("gpt"):  # fp32 parameters and gradients, AdamW's two fp32 moments
        closed = {"ddp": 4 * params, "fsdp": 4 * params / world}
        out["closed_form_error"] = {
            layout: {key: planned[layout].memory_mb[key] * 1e6 / (per * (2 if key == "optimizer_mb" else 1)) - 1
                     for key in ("params_mb", "grads_mb", "optimizer_mb")}
            for layout, per in closed.items()
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = _common.parser("plan_cost", __doc__)
    parser.add_argument("--tiny", action="store_true", help="small models (the smoke test)")
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # the child: one case, its JSON on the last line
        print(json.dumps(_case(args.case, args.tiny)))
        return
    results = []
    for name in CASES:
        command = [sys.executable, __file__, "--case", name, *(["--tiny"] if args.tiny else [])]
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=_common.REPO_ROOT)
        if done.returncode:
            raise SystemExit(f"plan_cost.py: case {name} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {"benchmark": "plan_cost", "command": _common.command_line("plan_cost.py", argv),
              "machine": _common.machine_info(),
              "tiny": args.tiny, "cases": results}  # fmt: skip
    rows = []
    for case in results:
        worst = max((abs(e) for errors in case.get("closed_form_error", {}).values() for e in errors.values()),
                    default=None)  # fmt: skip
        rows.append([case["case"], f"{case['params'] / 1e6:,.1f} M", case["world_size"], case["precision"],
                     f"{case['layouts']} ({case['refused']} refused)", f"{case['seconds']:.1f}",
                     f"{case['peak_rss_added_mb']:,.0f}", f"{case['peak_rss_mb']:,.0f}",
                     "" if worst is None else f"{worst:.1e}"])  # fmt: skip
    headers = ["case", "parameters", "processes", "precision", "layouts", "plan() s", "peak RSS added (MB)",
               "peak RSS, largest process (MB)", "state vs closed form (max rel. error)"]  # fmt: skip
    _common.write_outputs(result, args.out, _common.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
