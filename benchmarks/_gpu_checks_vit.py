"""Check 3 of ``gpu_check.py`` (documented there): ViT-B/16 images/s and MFU in fp32, bf16-mixed and 16-mixed."""

from __future__ import annotations

import gc
import time
from typing import Any

import _common
import torch
import torch.nn.functional as F
from _gpu_arms import Row, make_trainer, row, sync
from torch import nn

# ------------------------------------------------------------------------------------------- 3. ViT throughput


def check_vit(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    import timm
    from lightning.pytorch.callbacks import Callback

    from lit_accel import EfficiencyMonitor
    from lit_accel.callbacks._flops import measure_flops
    from lit_accel.utilities._peak_flops import lookup_peak_flops

    cuda, device = ctx["cuda"], ctx["device"]
    if ctx["dry_run"]:
        spec = dict(model="vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1)
        warmup, steps = 1, 1
    else:
        spec = dict(model="vit_base_patch16_224", img_size=224)
        warmup, steps = 4, 10
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32: TF32 off
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    def build() -> nn.Module:
        torch.manual_seed(0)
        kwargs = {k: v for k, v in spec.items() if k != "model"}
        return timm.create_model(spec["model"], pretrained=False, num_classes=1000, **kwargs)

    probe = build().to(device)
    x2 = torch.randn(2, 3, spec["img_size"], spec["img_size"], device=device)
    y2 = torch.zeros(2, dtype=torch.long, device=device)
    flops_per_image = measure_flops(lambda: F.cross_entropy(probe(x2), y2).backward()) / 2
    probe = None
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == warmup:
                sync(ctx)
                self.start = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            sync(ctx)
            self.end = time.perf_counter()

    def run(precision: str, batch_size: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, 3, spec["img_size"], spec["img_size"], generator=g).to(device)
        y = torch.randint(0, 1000, (batch_size,), generator=g).to(device)
        clock = Clock()
        monitor = EfficiencyMonitor(warmup_steps=warmup, print_summary=False, peak_flops=ctx["peak"])
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        plugins = _common.precision_plugins(precision)  # fp32: Lightning's own plugin
        trainer = make_trainer(ctx, plugins=plugins, callbacks=[clock, monitor], max_steps=warmup + steps)
        module = _common.classifier(build(), lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
        trainer.fit(module, train_dataloaders=_common.RepeatBatch((x, y), warmup + steps))
        ips = batch_size * steps / (clock.end - clock.start)
        matmul = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
        peak = ctx["peak"] or lookup_peak_flops(device_name, matmul)
        return {
            "images_per_s": ips,
            "tflops": flops_per_image * ips / 1e12,
            "mfu": None if peak is None else flops_per_image * ips / peak,
            "efficiency_monitor_mfu": monitor.summary.get("mfu"),
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        }

    batch = ctx["batch"]
    results: dict[str, Any] = {}
    while True:  # fp32 first: the largest batch that fits it serves all three precisions
        try:
            results["32-true"] = run("32-true", batch)
            break
        except torch.OutOfMemoryError:
            if batch <= 8:
                raise
            batch //= 2
            gc.collect()
            torch.cuda.empty_cache()
    for precision in ("bf16-mixed", "16-mixed"):
        results[precision] = run(precision, batch)
    rows = []
    for precision, r in results.items():
        speedup = r["images_per_s"] / results["32-true"]["images_per_s"]
        result = "INFO" if precision == "32-true" or ctx["dry_run"] else ("PASS" if speedup > 1 else "FAIL")
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        mon = r["efficiency_monitor_mfu"]
        mem = "" if r["peak_memory_gb"] is None else f", {r['peak_memory_gb']:.1f} GB"
        name = "fp32 (TF32 off)" if precision == "32-true" else precision
        rows.append(
            row(
                f"{spec['model']} b={batch} {name}",
                result,
                f"{r['images_per_s']:,.1f} img/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu}"
                f" (EfficiencyMonitor {'n/a' if mon is None else f'{mon:.1%}'}), x{speedup:.2f} vs fp32{mem}",
            )
        )
        r["speedup_vs_fp32"] = speedup
    return rows, {"model": spec, "batch": batch, "flops_per_image": flops_per_image, "device": device_name, **results}


CHECKS = {"vit": check_vit}
