"""What AccelParallel's model checks cost, once per fit (issue #45), on timm's ViT at ViT-Tiny's width and depth.

* ``chain`` (a pipeline split): ``forward`` traced with ``torch.fx``, units as leaves, and checked to be the units in
  order (``layout/chain.py``). Every rank runs the same deterministic check before the split, so it is timed here
  in one process (the median of ``--reps``).
* ``plan`` (a tensor plan): the numerical check at the first training forward (``layout/tensor_check.py``) under
  data 2 x tensor 2, 4 gloo processes: the seconds spent in its hooks and its verdict on the slowest rank, beside the
  first training step's time and the median of the later steps' (the check runs inside the first).

The model is ``tests/helpers/parallel.py``'s ``TimmViT``: timm's ``VisionTransformer`` (32 px images, 4 px patches,
width 192, depth 12, 3 heads: ViT-Tiny's sizes) with the pipeline units docs/strategies.md asks for; ``"auto"``
splits each block's Mlp (its fused qkv attention stays replicated). 8 images per replica per step, fp32, SGD.

Run (from the repository root; about 2 minutes on 2 cores)::

    python benchmarks/model_checks.py       # writes benchmarks/results/model_checks.json (+ .md)
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any

import _common
import torch

sys.path.insert(0, str(_common.REPO_ROOT))  # tests/helpers: the ViT with its pipeline units

VIT = {"depth": 12, "image": 32, "width": 192, "heads": 3}
WORLD, TENSOR, BATCH, STEPS = 4, 2, 8, 6


def _timed(function: Any, spent: list[float]) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    return run


def _plan_rank(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lit_accel import AccelParallel
    from lit_accel.layout.tensor_check import PlanCheck
    from tests.helpers.parallel import OUT, TimmViT

    spent = [0.0]  # the check's own seconds: its hooks' comparisons and its verdict (the benchmark wraps them)
    PlanCheck._compare = _timed(PlanCheck._compare, spent)  # type: ignore[method-assign]
    PlanCheck.verdict = _timed(PlanCheck.verdict, spent)  # type: ignore[method-assign]
    stamps: list[float] = []

    class Stamps(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            stamps.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            stamps.append(time.perf_counter())

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randn(64, OUT, generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=AccelParallel(tensor_parallel=TENSOR),
                         callbacks=[Stamps()], max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(TimmViT(**VIT), DataLoader(data, batch_size=BATCH))
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"check_s": spent[0], "first_step_s": steps[0], "later_step_s": statistics.median(steps[1:])}


def _chain_seconds(reps: int) -> float:
    from lit_accel.layout.chain import check_chain
    from lit_accel.layout.stages import pipeline_units
    from tests.helpers.parallel import TimmViT

    model = TimmViT(**VIT)
    names = [name for name, _ in pipeline_units(model)]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        check_chain("AccelParallel", model, names)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = _common.parser("model_checks", __doc__)
    parser.add_argument("--reps", type=_common.positive_int, default=5, help="timings of the chain check")
    args = parser.parse_args(argv)
    _common.quiet()
    chain = _chain_seconds(args.reps)
    ranks = _common.launch(_plan_rank, WORLD, timeout=900)
    slowest = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    result = {
        "command": _common.command_line("model_checks.py", argv),
        "machine": _common.machine_info(),
        "model": {"timm": "VisionTransformer", **VIT, "batch_per_replica": BATCH},
        "chain_check_s": chain,
        "plan_check": {"layout": "data 2 x tensor 2", **slowest, "per_rank": ranks},
    }
    rows = [
        ["chain (pipeline split)", "any (one process, before the split)", f"{chain:.3f}", "", ""],
        ["plan (tensor plan)", "data 2 x tensor 2, 4 processes", f"{slowest['check_s']:.3f}",
         f"{slowest['first_step_s']:.3f}", f"{slowest['later_step_s']:.3f}"],
    ]  # fmt: skip
    table = _common.markdown_table(
        ["check", "layout", "check (s, slowest rank)", "first step (s)", "later step median (s)"], rows
    )
    _common.write_outputs(result, args.out, table)


if __name__ == "__main__":
    main()
