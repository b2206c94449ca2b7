"""What the checks of ``gpu_check.py`` share: rows, Trainers, the models and their fits ("arms"), run once each.

An arm is one fit of a model (ViT-B/16, or a wide MLP where FP8 pays off) with a strategy, a precision and compiled or
not: 3 warm-up and 10 timed steps on a fixed batch already on the device, fused AdamW. Each arm runs once per process
and every check comparing against it reads the same run (the AccelDDP bf16 eager ViT is the reference of the fsdp,
compile and fp8 checks and is paid for once). Arms run in check order; an arm expected to win (compiled, FP8) runs
after its reference, so drift of the GPU's clocks works against it.

Not a library module: ``gpu_check.py`` puts ``benchmarks/`` first on ``sys.path``.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import _common
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import nn

Row = dict[str, str]
Check = Callable[[dict[str, Any]], tuple[list[Row], dict[str, Any]]]
_ARMS: dict[tuple[Any, ...], dict[str, Any]] = {}


def row(check: str, result: str, detail: str) -> Row:
    """One line of the table: ``result`` is PASS, FAIL, INFO or n/a."""
    return {"check": check, "result": result, "detail": detail}


def make_trainer(ctx: dict[str, Any], **kwargs: Any) -> Trainer:
    base = dict(accelerator="cuda" if ctx["cuda"] else "cpu", devices=1, **_common.QUIET_TRAINER)
    return Trainer(**{**base, **kwargs})


def sync(ctx: dict[str, Any]) -> None:
    if ctx["cuda"]:
        torch.cuda.synchronize()


def release(ctx: dict[str, Any]) -> None:
    gc.collect()
    if ctx["cuda"]:
        torch.cuda.empty_cache()


def fmt(value: float | None, spec: str = ".1%") -> str:
    return "n/a" if value is None else format(value, spec)


def falls(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------- models


def vit_spec(ctx: dict[str, Any]) -> dict[str, Any]:
    """ViT-B/16 on a GPU; in the dry run a one-block ViT whose Linear dims are multiples of 16 (FP8 converts all)."""
    if ctx["dry_run"]:
        timm_kwargs = dict(img_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=16)
        return dict(model="vit_tiny_patch16_224", timm=timm_kwargs, img=16, classes=16, batch=ctx["batch"],
                    warmup=2, steps=4, lr=1e-3)  # fmt: skip
    return dict(model="vit_base_patch16_224", timm=dict(num_classes=1000), img=224, classes=1000,
                batch=min(ctx["batch"], 128), warmup=3, steps=10, lr=3e-4)  # fmt: skip


def build_vit(spec: dict[str, Any]) -> nn.Module:
    import timm

    torch.manual_seed(0)  # every arm starts from the same weights
    return timm.create_model(spec["model"], pretrained=False, **spec["timm"])


def vit_batch(spec: dict[str, Any], size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 3, spec["img"], spec["img"], generator=g)
    return x.to(device), torch.randint(0, spec["classes"], (size,), generator=g).to(device)


class WideBlock(nn.Module):
    """A transformer's MLP half (pre-norm, 4x expansion, residual): the GEMMs where FP8 pays off."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class WideMLP(nn.Module):
    """``depth`` WideBlocks over ``(batch, tokens, width)``, mean-pooled into a 16-way head."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(WideBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def wide_spec(ctx: dict[str, Any]) -> dict[str, Any]:
    """Width 4096, 4 blocks, 16 x 512 tokens on a GPU (8192-row GEMMs, 2.2 TFLOP per block forward); tiny dry run."""
    if ctx["dry_run"]:
        return dict(model="wide_mlp", width=32, depth=1, tokens=8, batch=2, warmup=2, steps=4, lr=1e-3)
    return dict(model="wide_mlp", width=4096, depth=4, tokens=512, batch=16, warmup=3, steps=10, lr=1e-4)


def build(spec: dict[str, Any]) -> nn.Module:
    return WideMLP(spec["width"], spec["depth"]) if spec["model"] == "wide_mlp" else build_vit(spec)


def batch_for(spec: dict[str, Any], size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if spec["model"] != "wide_mlp":
        return vit_batch(spec, size, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, spec["tokens"], spec["width"], generator=g)
    return x.to(device), torch.randint(0, 16, (size,), generator=g).to(device)


def classifier(net: nn.Module, lr: float) -> LightningModule:
    """Cross-entropy on ``net`` with fused AdamW; keeps each step's loss on the device (read once, after fit)."""

    class Classifier(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)

    return Classifier()


# ------------------------------------------------------------------------------------------- arms


class Clock(Callback):
    """Wall time from the start of batch ``start`` to the end of fit, CUDA-synchronised at both ends."""

    def __init__(self, ctx: dict[str, Any], start: int) -> None:
        self.ctx, self.start = ctx, start
        self.t0 = self.t1 = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            sync(self.ctx)
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sync(self.ctx)
        self.t1 = time.perf_counter()


def fp8_hardware(ctx: dict[str, Any]) -> bool:
    return ctx["cuda"] and torch.cuda.get_device_capability(ctx["device"]) >= (8, 9)


def float8_conversion(ctx: dict[str, Any]) -> Any:
    """None (FP8 tensor cores on capability >= 8.9, emulation on CPU), or forced emulation on an older GPU."""
    from lit_accel.plugins import Float8Conversion

    return Float8Conversion(emulate=True) if ctx["cuda"] and not fp8_hardware(ctx) else None


def arm(ctx: dict[str, Any], spec: dict[str, Any], strategy: str, precision: str, compiled: bool) -> dict[str, Any]:
    """One fit of ``spec``'s model (``strategy`` "ddp" or "fsdp"): images/s, losses, the monitor's figures; once."""
    from lit_accel import AccelDDP, AccelFSDP, EfficiencyMonitor

    key = (strategy, precision, compiled, spec["model"], spec["batch"], str(ctx["device"]))
    if key in _ARMS:
        return {**_ARMS[key], "shared": True}
    compile_arg: Any = ({"backend": "aot_eager"} if ctx["dry_run"] else True) if compiled else False
    if compiled:
        torch.compiler.reset()  # a cold start for each compiled arm (inductor's on-disk cache still serves)
    # hang_timeout=None: the strategies' default watchdog only reports (after 300 s), so a cold inductor compile
    # outside the first step cannot end the whole script. The same for every arm, so the comparisons stay paired.
    options = dict(compile=compile_arg, hang_timeout=None)
    strat = AccelFSDP(**options) if strategy == "fsdp" else AccelDDP(**options)
    options8 = {"float8": float8_conversion(ctx)} if precision == "fp8-mixed" else {}
    plugins = _common.precision_plugins(precision, **options8)  # fp32: Lightning's own plugin
    clock = Clock(ctx, spec["warmup"])
    monitor = EfficiencyMonitor(warmup_steps=spec["warmup"], print_summary=False, peak_flops=ctx["peak"])
    n = spec["warmup"] + spec["steps"]
    module = classifier(build(spec), spec["lr"])
    fit = make_trainer(ctx, strategy=strat, plugins=plugins, callbacks=[clock, monitor], max_steps=n)
    start = time.perf_counter()
    try:
        fit.fit(module, train_dataloaders=_common.RepeatBatch(batch_for(spec, spec["batch"], ctx["device"]), n))
        summary = dict(monitor.summary)  # keys may change: read with .get
        report = plugins[0].float8_report if plugins else None
        result = {
            "images_per_s": spec["batch"] * spec["steps"] / (clock.t1 - clock.t0),
            "losses": torch.stack(module.losses).float().tolist(),
            "mfu": summary.get("mfu"),
            "flops_per_sample": getattr(monitor, "flops_per_sample", None),
            "recompiles": summary.get("recompiles"),
            "efficiency_summary": summary,
            "float8": None
            if report is None
            else {"message": report.message, "converted": len(report.converted), "emulated": report.emulated},
            "compile": compile_arg,
            "batch": spec["batch"],
            "timed_steps": spec["steps"],
            "fit_seconds": time.perf_counter() - start,  # set-up, compilation and warm-up included
        }
    finally:
        del fit, module
        release(ctx)
    _ARMS[key] = result
    return result


def vit_arm(ctx: dict[str, Any], strategy: str, precision: str, compiled: bool) -> dict[str, Any]:
    return arm(ctx, vit_spec(ctx), strategy, precision, compiled)
