"""Per-rank memory by category of the CIFAR-sized ViT under fp32 / bf16 / fp16, AccelDDP vs AccelFSDP, with and without
activation checkpointing, as the MemoryMonitor measures it on 2 gloo processes.

Two CPU processes joined by gloo (``_common.launch``) train the ViT of ``overhead.py`` (timm ``vit_tiny_patch16_224``
at 32x32 px, patch 4, width 192, depth 6, 2.7 M parameters, 16 images per process, AdamW) for a few optimizer steps
in each of nine arms: ``ddp`` (``AccelDDP()``), ``fsdp`` (``AccelFSDP()``, which shards each ViT ``Block`` and the
root) and ``fsdp_ac`` (``AccelFSDP(activation_checkpointing=True)``: the blocks recompute their activations in the
backward), each at ``32-true``, ``AccelPrecision("bf16-mixed")`` and ``AccelPrecision("16-mixed")``.

Every figure comes from ``MemoryMonitor`` (``lit_accel/callbacks/memory_monitor.py``): bytes of parameters, of
gradients and of optimizer state this rank holds (local shards under FSDP), read just before a logging step's
optimizer step; activations: the unique storages autograd saves for the backward during the first training
micro-batch's forward (parameters excluded, autocast's saved copies of parameters counted apart as ``param_casts``).
Sizes are tensor metadata, so they do not vary between runs: one fit per arm, no repetitions, no timing. Peak
allocated/reserved memory is the CUDA caching allocator's and is absent on CPU.

Run (from the repository root)::

    python benchmarks/memory.py             # writes benchmarks/results/memory.json (+ .md)
    python benchmarks/memory.py --tiny      # a few seconds: a 2-block ViT, checks that it runs
"""

from __future__ import annotations

import time
from typing import Any

import _common
import torch
from overhead import build_net, make_loader

STRATEGIES = ("ddp", "fsdp", "fsdp_ac")
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
CATEGORIES = ("params", "grads", "optimizer", "activations", "param_casts")


def _net(model: str) -> torch.nn.Module:
    if model == "vit":
        return build_net("vit")
    import timm  # --tiny: two blocks, so that activation checkpointing still has blocks to checkpoint

    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8, depth=2, embed_dim=32,
        num_heads=2,
    )  # fmt: skip


def _classifier(net: torch.nn.Module) -> Any:
    """``_common.classifier`` with a ``forward``: ``training_step`` calls ``self(x)``, so that FSDP2's root hooks run.

    (``fully_shard`` on the LightningModule hooks its ``forward``; a ``training_step`` that calls ``self.net(x)``
    leaves the root's own parameters - patch embedding, head - sharded in the forward and fails under AccelFSDP.)
    """
    import torch.nn.functional as F

    module = _common.classifier(net, lambda params: torch.optim.AdamW(params, lr=1e-4))

    class Classifier(type(module)):  # type: ignore[misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

    module.__class__ = Classifier
    return module


def run_arm(strategy_name: str, precision: str, args: Any, loader: Any, world_size: int) -> dict[str, Any]:
    """One fit; returns every rank's bytes (rank 0 holds them all after the monitor's gather) and the summary."""
    import lightning.pytorch as pl

    from lit_accel import AccelDDP, AccelFSDP, AccelPrecision
    from lit_accel.callbacks.memory_monitor import MemoryMonitor

    if strategy_name == "ddp":
        strategy: Any = AccelDDP(sync_batchnorm=False)
    else:
        strategy = AccelFSDP(sync_batchnorm=False, activation_checkpointing=strategy_name == "fsdp_ac")
    plugins = [] if precision == "32-true" else [AccelPrecision(precision)]  # type: ignore[arg-type]
    monitor = MemoryMonitor(print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        plugins=plugins,
        callbacks=[monitor],
        max_steps=args.steps,
        log_every_n_steps=args.steps,  # the state is sized at the last step: optimizer state exists by then
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(_classifier(_net(args.model)), train_dataloaders=loader)
    assert monitor.meter is not None
    return {"per_rank": [row.as_dict() for row in monitor.meter.rows], "summary": monitor.summary}


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    loader = make_loader(rank, world_size, args.batch, args.steps)
    arms = {
        f"{s}/{p}": run_arm(s, precision, args, loader, world_size)
        for s in STRATEGIES
        for p, precision in PRECISIONS.items()
    }
    return {"arms": arms, "params": sum(p.numel() for p in _net(args.model).parameters())}


def _mb(nbytes: float) -> float:
    return round(nbytes / 1e6, 3)


def _arm_result(arm: dict[str, Any]) -> dict[str, Any]:
    """Per rank and category, MB (and the dtype split); the total per rank; the summary's levers."""
    per_rank = []
    for row in arm["per_rank"]:
        entry: dict[str, Any] = {}
        for category in CATEGORIES:
            value = row[category]
            entry[category] = _mb(value["total"] if isinstance(value, dict) else value)
        entry["total"] = round(sum(entry[c] for c in CATEGORIES), 3)
        entry["activations_by_dtype"] = {k: _mb(v) for k, v in row["activations"]["by_dtype"].items()}
        entry["params_unsharded"] = _mb(row["params_unsharded"])
        per_rank.append(entry)
    summary = arm["summary"]
    levers = ("sharding_saved_mb", "autocast_saved_mb", "activations_fp32_equivalent_mb")
    return {
        "per_rank_mb": per_rank,
        "max_over_ranks_mb": {c: max(r[c] for r in per_rank) for c in (*CATEGORIES, "total")},
        "spread": {k: round(v, 4) for k, v in summary.items() if k.endswith("_spread")},
        "levers_mb": {k.removesuffix("_mb"): round(summary[k], 3) for k in levers if k in summary},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("memory", __doc__)
    p.add_argument("--model", choices=("vit", "tiny_vit"), default="vit", help="the ViT of overhead.py, or 2 blocks")
    p.add_argument("--batch", type=_common.positive_int, default=16, help="images per process")
    p.add_argument("--steps", type=_common.positive_int, default=2, help="optimizer steps per fit (the last is logged)")
    p.add_argument("--world-size", type=_common.positive_int, default=2, help="processes")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes: 2-block ViT of width 32, 4 images")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.batch = "tiny_vit", 4
    machine = _common.machine_info()
    start = time.perf_counter()
    rank0 = _common.launch(worker, args.world_size, args)[0]
    wall = time.perf_counter() - start
    arms = {name: _arm_result(arm) for name, arm in rank0["arms"].items()}
    base = arms["ddp/fp32"]["max_over_ranks_mb"]
    for arm in arms.values():
        arm["total_vs_ddp_fp32"] = round(arm["max_over_ranks_mb"]["total"] / base["total"], 4)
        arm["activations_vs_ddp_fp32"] = round(arm["max_over_ranks_mb"]["activations"] / base["activations"], 4)
    result: dict[str, Any] = {
        "benchmark": "memory",
        "command": _common.command_line("memory.py", argv),
        "machine": machine,
        "wall_s": round(wall, 1),
        "setup": {
            "model": args.model,
            "parameters": rank0["params"],
            "micro_batch_per_process": args.batch,
            "world_size": args.world_size,
            "backend": "gloo",
            "optimizer": "AdamW(lr=1e-4)",
            "steps_per_fit": args.steps,
            "measured_by": "MemoryMonitor (lit_accel/callbacks/memory_monitor.py)",
            "mb": "1e6 bytes; per rank: the largest rank's",
        },
        "arms": arms,
    }
    rows = [
        [name, *(f"{a['max_over_ranks_mb'][c]:.2f}" for c in (*CATEGORIES, "total")), f"{a['total_vs_ddp_fp32']:.3f}",
         f"{a['activations_vs_ddp_fp32']:.3f}", f"{a['levers_mb'].get('sharding_saved', 0):.2f}",
         f"{a['levers_mb'].get('autocast_saved', 0):.2f}"]
        for name, a in arms.items()
    ]  # fmt: skip
    table = _common.markdown_table(
        ["arm", "params (MB)", "grads (MB)", "optimizer (MB)", "activations (MB)", "autocast weight copies (MB)",
         "total (MB)", "total / ddp fp32", "activations / ddp fp32", "saved by sharding (MB)",
         "saved by autocast, est. (MB)"],
        rows,
    )  # fmt: skip
    dtype_rows = [
        [name, ", ".join(f"{k} {v:.2f}" for k, v in a["per_rank_mb"][0]["activations_by_dtype"].items())]
        for name, a in arms.items()
    ]
    table += "\n" + _common.markdown_table(["arm", "rank 0 activations by dtype (MB)"], dtype_rows)
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
