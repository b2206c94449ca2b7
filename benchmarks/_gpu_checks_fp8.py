"""The FP8 check of ``gpu_check.py``: lit_accel's ``"fp8-mixed"`` judged where FP8 pays off, ViT-B/16 as information.

FP8 matmuls win only when the GEMMs are large enough for the faster matmul to outweigh the amax, scale and cast
kernels around it (torchao's float8 documentation gives its speedups by GEMM shape). ViT-B/16's GEMMs are 768 wide,
so a slower fp8 ViT says nothing about lit_accel; its rows are INFO. The judged rows use ``WideMLP``
(width 4096, 4x expansion, 16 x 512 tokens): compiled FP8 must beat compiled bf16 on FP8 tensor cores. A last fit
trains the ViT on 3 images (3 x 197 = 591 rows, which ``torch._scaled_mm`` refuses unpadded): ``RowPadding`` at work.
"""

from __future__ import annotations

import math
from typing import Any

import _common
import torch
from _gpu_arms import (
    Row,
    arm,
    build_vit,
    classifier,
    float8_conversion,
    fmt,
    fp8_hardware,
    make_trainer,
    release,
    row,
    vit_arm,
    vit_batch,
    vit_spec,
    wide_spec,
)

PARTIAL_BATCH = 3  # ViT-B/16: 3 x 197 tokens = 591 rows, not a multiple of 16


def _arms(run: Any, compiled: tuple[bool, ...]) -> dict[tuple[str, bool], dict[str, Any]]:
    return {(p, c): run(p, c) for c in compiled for p in ("bf16-mixed", "fp8-mixed")}


def _speed_rows(name: str, arms: dict[tuple[str, bool], dict[str, Any]]) -> list[Row]:
    rows = []
    for (precision, compiled), result in arms.items():
        ref = arms[("bf16-mixed", compiled)]["images_per_s"]
        rows.append(
            row(
                f"{name} {precision}{' + compile' if compiled else ''} samples/s",
                "INFO",
                f"{result['images_per_s']:,.1f}/s (x{result['images_per_s'] / ref:.2f} vs bf16), EfficiencyMonitor MFU"
                f" {fmt(result['mfu'])}, loss {result['losses'][0]:.4g} -> {result['losses'][-1]:.4g}, recompiles"
                f" {fmt(result['recompiles'], 'g')}",
            )
        )
    return rows


def _partial_batch(ctx: dict[str, Any]) -> tuple[Row, dict[str, Any]]:
    from lit_accel import AccelPrecision

    spec = vit_spec(ctx)
    module = classifier(build_vit(spec), spec["lr"])
    plugin = AccelPrecision("fp8-mixed", float8=float8_conversion(ctx))
    fit = make_trainer(ctx, plugins=[plugin], max_steps=2)
    tokens = (spec["img"] // spec["timm"].get("patch_size", 16)) ** 2 + 1
    try:
        fit.fit(module, train_dataloaders=_common.RepeatBatch(vit_batch(spec, PARTIAL_BATCH, ctx["device"]), 2))
        losses = torch.stack(module.losses).float().tolist()
        error = None
    except Exception as exc:  # the crash this row exists to rule out: report it, do not end the script
        losses, error = [], f"{type(exc).__name__}: {exc}"[:300]
    finally:
        del fit, module
        release(ctx)
    ok = error is None and len(losses) == 2 and all(math.isfinite(v) for v in losses)
    where = "FP8 tensor cores" if fp8_hardware(ctx) else "emulated"
    detail = f"{spec['model']}, {PARTIAL_BATCH} x {tokens} tokens = {PARTIAL_BATCH * tokens} rows ({where}): " + (
        error or f"losses {', '.join(f'{v:.4g}' for v in losses)}"
    )
    return row(f"fp8-mixed trains a batch of {PARTIAL_BATCH}", "PASS" if ok else "FAIL", detail), {
        "losses": losses,
        "error": error,
    }


def check_fp8(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    real = fp8_hardware(ctx)
    # ViT-B/16 eager only: its compiled FP8 arm would cost a cold compile (~1 min) for an INFO row.
    vit = _arms(lambda p, c: vit_arm(ctx, "ddp", p, c), (False,))
    wide_model = wide_spec(ctx)
    wide = _arms(lambda p, c: arm(ctx, wide_model, "ddp", p, c), (False, True))
    rows = _speed_rows(vit_spec(ctx)["model"], vit) + _speed_rows("wide MLP", wide)

    fp8 = [result for (precision, _), result in [*vit.items(), *wide.items()] if precision == "fp8-mixed"]
    report = vit[("fp8-mixed", False)]["float8"] or {}
    expect_emulated = not real
    ok = all(a["float8"] and a["float8"]["converted"] > 0 and a["float8"]["emulated"] == expect_emulated for a in fp8)
    ok = ok and all(math.isfinite(v) for a in fp8 for v in a["losses"])
    rows.append(
        row(
            "fp8-mixed conversion",
            "PASS" if ok else "FAIL",
            f"{report.get('message', 'no report')} (expected {'emulated' if expect_emulated else 'tensor cores'});"
            " losses finite",
        )
    )
    where = "capability >= 8.9" if real else ("CPU dry run: emulated" if not ctx["cuda"] else "GPU < 8.9: emulated")
    ratios = {
        "wide MLP": wide[("fp8-mixed", True)]["images_per_s"] / wide[("bf16-mixed", True)]["images_per_s"],
        "ViT eager": vit[("fp8-mixed", False)]["images_per_s"] / vit[("bf16-mixed", False)]["images_per_s"],
    }
    judged = ("PASS" if ratios["wide MLP"] > 1.0 else "FAIL") if real else "INFO"
    width = f"width {wide_model['width']}, {wide_model['batch']} x {wide_model['tokens']} tokens"
    rows.append(
        row("fp8 + compile vs bf16 + compile, wide MLP", judged, f"x{ratios['wide MLP']:.2f} ({width}; {where})")
    )
    rows.append(
        row(
            "fp8 vs bf16, ViT-B/16 eager (information)",
            "INFO",
            f"x{ratios['ViT eager']:.2f} ({where}; 768-wide GEMMs are below where FP8 pays off)",
        )
    )
    partial, partial_data = _partial_batch(ctx)
    rows.append(partial)
    data = {f"vit {p}{'+compile' if c else ''}": a for (p, c), a in vit.items()}
    data.update({f"wide {p}{'+compile' if c else ''}": a for (p, c), a in wide.items()})
    return rows, {**data, "fp8_over_bf16": ratios, "fp8_hardware": real, "partial_batch": partial_data}


CHECKS = {"fp8": check_fp8}
