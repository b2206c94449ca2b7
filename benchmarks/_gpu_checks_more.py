"""Checks 5-9 of ``gpu_check.py`` (documented there): AccelFSDP, compiled blocks, FP8, MemoryMonitor, auto micro-batch.

Each ``check_*`` takes the script's ``ctx`` and returns ``(rows, data)``. The ViT fits are shared: an arm (strategy,
precision, compiled or not) runs once per process and every check comparing against it reads the same run, so the
AccelDDP bf16 eager arm is the reference of the fsdp, compile and fp8 checks and is paid for once. Arms run in check
order; an arm expected to win (compiled, FP8) runs after its reference, so drift of the GPU's clocks works against it.

Not a library module: ``gpu_check.py`` imports it as ``_gpu_checks_more`` (``benchmarks/`` is first on ``sys.path``).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import _common
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import nn

Row = dict[str, str]
# Compiled and eager kernels round bf16 differently (fusion, reduction order): 4 units of bf16's rounding (2**-8).
BF16_RTOL = 2.0**-6
LOSS_STEPS = 3  # the first losses compared between compiled and eager
_ARMS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _row(check: str, result: str, detail: str) -> Row:
    return {"check": check, "result": result, "detail": detail}


def _trainer(ctx: dict[str, Any], **kwargs: Any) -> Trainer:
    base = dict(accelerator="cuda" if ctx["cuda"] else "cpu", devices=1, **_common.QUIET_TRAINER)
    return Trainer(**{**base, **kwargs})


def _sync(ctx: dict[str, Any]) -> None:
    if ctx["cuda"]:
        torch.cuda.synchronize()


def _release(ctx: dict[str, Any]) -> None:
    gc.collect()
    if ctx["cuda"]:
        torch.cuda.empty_cache()


def _fmt(value: float | None, spec: str = ".1%") -> str:
    return "n/a" if value is None else format(value, spec)


# ------------------------------------------------------------------------------------------- the ViT and its arms


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


class _Clock(Callback):
    """Wall time from the start of batch ``start`` to the end of fit, CUDA-synchronised at both ends."""

    def __init__(self, ctx: dict[str, Any], start: int) -> None:
        self.ctx, self.start = ctx, start
        self.t0 = self.t1 = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            _sync(self.ctx)
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(self.ctx)
        self.t1 = time.perf_counter()


def _float8(ctx: dict[str, Any]) -> Any:
    """None (FP8 tensor cores on capability >= 8.9, emulation on CPU), or forced emulation on an older GPU."""
    from lit_accel.plugins import Float8Conversion

    return Float8Conversion(emulate=True) if ctx["cuda"] and not fp8_hardware(ctx) else None


def fp8_hardware(ctx: dict[str, Any]) -> bool:
    return ctx["cuda"] and torch.cuda.get_device_capability(ctx["device"]) >= (8, 9)


def vit_arm(ctx: dict[str, Any], strategy: str, precision: str, compiled: bool) -> dict[str, Any]:
    """One ViT fit (``strategy`` "ddp" or "fsdp"): images/s, losses, the EfficiencyMonitor's figures; run once."""
    from lit_accel import AccelDDP, AccelFSDP, AccelPrecision, EfficiencyMonitor

    spec = vit_spec(ctx)
    key = (strategy, precision, compiled, spec["model"], spec["batch"], str(ctx["device"]))
    if key in _ARMS:
        return {**_ARMS[key], "shared": True}
    compile_arg: Any = ({"backend": "aot_eager"} if ctx["dry_run"] else True) if compiled else False
    if compiled:
        torch.compiler.reset()  # a cold start for each compiled arm (inductor's on-disk cache still serves)
    # No HangWatchdog: a cold inductor compile outside the first step could exceed its 30 s phase allowance, and the
    # watchdog would end the whole script. The same for every arm, so the comparisons stay paired.
    options = dict(compile=compile_arg, hang_timeout=None)
    strat = AccelFSDP(**options) if strategy == "fsdp" else AccelDDP(**options)
    plugin = AccelPrecision(precision, float8=_float8(ctx)) if precision == "fp8-mixed" else AccelPrecision(precision)
    clock = _Clock(ctx, spec["warmup"])
    monitor = EfficiencyMonitor(warmup_steps=spec["warmup"], print_summary=False, peak_flops=ctx["peak"])
    n = spec["warmup"] + spec["steps"]
    module = classifier(build_vit(spec), spec["lr"])
    trainer = _trainer(ctx, strategy=strat, plugins=[plugin], callbacks=[clock, monitor], max_steps=n)
    start = time.perf_counter()
    try:
        trainer.fit(module, train_dataloaders=_common.RepeatBatch(vit_batch(spec, spec["batch"], ctx["device"]), n))
        summary = dict(monitor.summary)  # keys may change: read with .get
        report = plugin.float8_report
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
        del trainer, module
        _release(ctx)
    _ARMS[key] = result
    return result


def _falls(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------- 5. AccelFSDP


def check_fsdp(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    fsdp = vit_arm(ctx, "fsdp", "bf16-mixed", compiled=False)
    ddp = vit_arm(ctx, "ddp", "bf16-mixed", compiled=False)
    fl, dl = fsdp["losses"], ddp["losses"]
    # Falling, and by at least half as much as AccelDDP's run from the same weights on the same batch.
    ok = _falls(fl) and fl[0] - fl[-1] >= 0.5 * (dl[0] - dl[-1])
    ratio = fsdp["images_per_s"] / ddp["images_per_s"]
    name = vit_spec(ctx)["model"]
    rows = [
        _row(
            "AccelFSDP bf16-mixed trains (1 device)",
            "PASS" if ok else "FAIL",
            f"{name}: loss {fl[0]:.4g} -> {fl[-1]:.4g} in {len(fl)} steps on a fixed batch (AccelDDP"
            f" {dl[0]:.4g} -> {dl[-1]:.4g}); finite: {all(math.isfinite(v) for v in fl)}",
        ),
        _row(
            "AccelFSDP vs AccelDDP images/s",
            "INFO",
            f"FSDP {fsdp['images_per_s']:,.1f}, DDP {ddp['images_per_s']:,.1f} img/s: x{ratio:.2f}"
            f" (b={fsdp['batch']}, one device, so sharding buys nothing here)",
        ),
    ]
    return rows, {"fsdp": fsdp, "ddp": ddp, "fsdp_over_ddp": ratio}


# ------------------------------------------------------------------------------------------- 6. compile


def check_compile(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    eager = vit_arm(ctx, "ddp", "bf16-mixed", compiled=False)
    comp = vit_arm(ctx, "ddp", "bf16-mixed", compiled=True)
    ratio = comp["images_per_s"] / eager["images_per_s"]
    backend = "aot_eager" if ctx["dry_run"] else "inductor"
    speed = "INFO" if not ctx["cuda"] else ("PASS" if ratio >= 1.0 else "FAIL")
    first_e, first_c = eager["losses"][:LOSS_STEPS], comp["losses"][:LOSS_STEPS]
    rel = max(abs(c - e) / abs(e) for c, e in zip(first_c, first_e))
    same = all(math.isfinite(v) for v in first_c) and rel <= BF16_RTOL
    rows = [
        _row(
            f"AccelDDP(compile) {backend} vs eager images/s",
            speed,
            f"eager {eager['images_per_s']:,.1f}, compiled {comp['images_per_s']:,.1f} img/s: x{ratio:.2f}"
            f" (bf16-mixed, b={comp['batch']}); recompiles after warm-up: {_fmt(comp['recompiles'], 'g')}",
        ),
        _row(
            f"AccelDDP(compile) first {LOSS_STEPS} losses == eager",
            "PASS" if same else "FAIL",
            f"max relative difference {rel:.1e} (tolerance {BF16_RTOL:.1e}); eager"
            f" {', '.join(f'{v:.5g}' for v in first_e)}; compiled {', '.join(f'{v:.5g}' for v in first_c)}",
        ),
    ]
    return rows, {"eager": eager, "compiled": comp, "compiled_over_eager": ratio, "max_rel_loss_diff": rel}


# ------------------------------------------------------------------------------------------- 7. FP8


def check_fp8(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    arms = {
        (precision, compiled): vit_arm(ctx, "ddp", precision, compiled)
        for compiled in (False, True)
        for precision in ("bf16-mixed", "fp8-mixed")
    }
    rows = []
    for (precision, compiled), arm in arms.items():
        ref = arms[("bf16-mixed", compiled)]["images_per_s"]
        rows.append(
            _row(
                f"{precision}{' + compile' if compiled else ''} ViT images/s",
                "INFO",
                f"{arm['images_per_s']:,.1f} img/s (x{arm['images_per_s'] / ref:.2f} vs bf16), EfficiencyMonitor MFU"
                f" {_fmt(arm['mfu'])}, loss {arm['losses'][0]:.4g} -> {arm['losses'][-1]:.4g}",
            )
        )
    real = fp8_hardware(ctx)
    fp8 = [arms[("fp8-mixed", c)] for c in (False, True)]
    report = fp8[1]["float8"] or {}
    expect_emulated = not real
    ok = all(a["float8"] and a["float8"]["converted"] > 0 and a["float8"]["emulated"] == expect_emulated for a in fp8)
    ok = ok and all(math.isfinite(v) for a in fp8 for v in a["losses"])
    rows.append(
        _row(
            "fp8-mixed conversion",
            "PASS" if ok else "FAIL",
            f"{report.get('message', 'no report')} (expected {'emulated' if expect_emulated else 'tensor cores'});"
            " losses finite",
        )
    )
    ratio = arms[("fp8-mixed", True)]["images_per_s"] / arms[("bf16-mixed", True)]["images_per_s"]
    where = "capability >= 8.9" if real else ("CPU dry run: emulated" if not ctx["cuda"] else "GPU < 8.9: emulated")
    rows.append(
        _row(
            "fp8 + compile vs bf16 + compile",
            ("PASS" if ratio > 1.0 else "FAIL") if real else "INFO",
            f"x{ratio:.2f} images/s ({where})",
        )
    )
    data = {f"{p}{'+compile' if c else ''}": arm for (p, c), arm in arms.items()}
    return rows, {**data, "fp8_over_bf16_compiled": ratio, "fp8_hardware": real}


# ------------------------------------------------------------------------------------------- 8. MemoryMonitor


class _SizedRepeat(_common.RepeatBatch):
    """``RepeatBatch`` with a ``batch_size``: ``AccelDDP(global_batch_size=...)`` reads the loaded size from it."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
        super().__init__(batch, n)
        self.batch_size = len(batch[0])


class _ForwardAllocation(Callback):
    """``torch.cuda.memory_allocated`` around the first training forward (MemoryMonitor's window: batch start to
    ``on_before_backward``, the loss included)."""

    def __init__(self, ctx: dict[str, Any]) -> None:
        self.ctx = ctx
        self.before: int | None = None
        self.after: int | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.ctx["cuda"] and batch_idx == 0:
            self.before = torch.cuda.memory_allocated(self.ctx["device"])

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.ctx["cuda"] and self.after is None:
            self.after = torch.cuda.memory_allocated(self.ctx["device"])


def check_memory(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    from lit_accel import AccelPrecision, MemoryMonitor

    spec = {**vit_spec(ctx), "batch": 4 if ctx["dry_run"] else 32}
    monitor, probe = MemoryMonitor(print_summary=False), _ForwardAllocation(ctx)
    module = classifier(build_vit(spec), spec["lr"])
    trainer = _trainer(ctx, plugins=[AccelPrecision("bf16-mixed")], callbacks=[monitor, probe], max_steps=2)
    trainer.fit(module, train_dataloaders=_common.RepeatBatch(vit_batch(spec, spec["batch"], ctx["device"]), 2))
    del trainer, module
    _release(ctx)
    s = dict(monitor.summary)

    def get(name: str) -> float | None:
        return s.get(name, s.get(f"mem/{name}"))

    activations, casts, peak = get("activations_mb"), get("param_casts_mb"), get("peak_allocated_mb")
    # Both are held from the forward to the backward: the saved activations and autocast's saved weight copies.
    held = None if activations is None else activations + (casts or 0.0)
    grown = None if probe.after is None or probe.before is None else (probe.after - probe.before) / 1e6
    what = f"activations {_fmt(activations, '.4g')} + param casts {_fmt(casts, '.4g')} MB"
    if held is None:
        result, detail = "FAIL", f"no activations_mb in MemoryMonitor.summary (keys: {sorted(s)})"
    elif grown is None:
        result, detail = "INFO", f"{what}; CPU dry run: no CUDA allocator to compare with"
    else:
        ratio = held / grown
        result = "PASS" if abs(ratio - 1.0) <= 0.25 else "FAIL"
        detail = f"{what} = {held:.1f} MB vs memory_allocated +{grown:.1f} MB over the forward: x{ratio:.3f}"
    peak_row = (
        _row("MemoryMonitor peak_allocated_mb", "PASS" if peak else "FAIL", f"{_fmt(peak, ',.1f')} MB")
        if ctx["cuda"]
        else _row("MemoryMonitor peak_allocated_mb", "INFO", f"CPU dry run: {'absent' if peak is None else peak}")
    )
    rows = [_row(f"MemoryMonitor activations (bf16, b={spec['batch']})", result, detail), peak_row]
    return rows, {"summary": s, "allocated_growth_mb": grown, "held_mb": held}


# ------------------------------------------------------------------------------------------- 9. auto micro-batch


def _footprint(ctx: dict[str, Any], spec: dict[str, Any]) -> dict[str, float]:
    """Bytes a bf16 training forward holds per sample and per forward (autocast's weight copies), and parameters."""
    device = ctx["device"]
    net = build_vit(spec).to(device)
    grown = []
    for size in (4, 8):
        x, y = vit_batch(spec, size, device)
        before = torch.cuda.memory_allocated(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        grown.append(torch.cuda.memory_allocated(device) - before)
        del loss, x, y
    params = float(sum(p.numel() for p in net.parameters()))
    del net
    _release(ctx)
    per_sample = (grown[1] - grown[0]) / 4
    return {"per_sample": per_sample, "per_forward": max(grown[0] - 4 * per_sample, 0.0), "params": params}


def check_micro_batch_auto(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    from lit_accel import AccelDDP, AccelFSDP

    rows, data = [], {}
    # no SyncBN and no buffer broadcast: AccelDDP then searches by attempts (AccelFSDP always measures)
    for name, make in (
        ("AccelDDP", lambda n: AccelDDP(global_batch_size=n, micro_batch_size="auto", sync_batchnorm=False,
                                        broadcast_buffers=False)),
        ("AccelFSDP", lambda n: AccelFSDP(global_batch_size=n, micro_batch_size="auto", sync_batchnorm=False)),
    ):  # fmt: skip
        row, data[name] = _micro_batch_auto(ctx, name, make)
        rows.append(row)
    return rows, data


def _micro_batch_auto(ctx: dict[str, Any], name: str, make: Any) -> tuple[Row, dict[str, Any]]:
    from lit_accel import AccelPrecision

    spec = {**vit_spec(ctx), "batch": ctx["batch"] if ctx["dry_run"] else 256}
    loaded, device, data = spec["batch"], ctx["device"], {}
    fraction = budget = None
    if ctx["cuda"]:
        f = _footprint(ctx, spec)
        target = loaded // 4
        # Step 0 holds weights and DDP's gradient buckets (8 bytes/parameter), later steps AdamW's moments too (16).
        # The cap sits midway between `target` after step 0 and twice `target` at step 0, so the full batch and half
        # of it fail in their forward and `target` keeps fitting once the optimizer state exists. (FSDP on one GPU
        # holds about as much: fp32 parameters and gradients, a bf16 gathered copy.)
        need_target = 16 * f["params"] + f["per_forward"] + target * f["per_sample"]
        need_double = 8 * f["params"] + f["per_forward"] + 2 * target * f["per_sample"]
        budget = (need_target + need_double) / 2
        data.update(footprint=f, target=target, need_target_mb=need_target / 1e6, need_double_mb=need_double / 1e6)
    batch = vit_batch(spec, loaded, device)
    strategy = make(loaded)
    module = classifier(build_vit(spec), spec["lr"])
    trainer = _trainer(ctx, strategy=strategy, plugins=[AccelPrecision("bf16-mixed")], max_steps=4)
    try:
        if budget is not None:
            _release(ctx)
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = (torch.cuda.memory_reserved(device) + budget) / total
            torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), device)
        trainer.fit(module, train_dataloaders=_SizedRepeat(batch, 4))
    finally:
        if ctx["cuda"]:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    micro = strategy.micro_batch_size  # chosen before the first step, kept for the fit
    finite = all(math.isfinite(v) for v in torch.stack(module.losses).float().tolist())
    del trainer, module, batch
    _release(ctx)
    detail = f"loaded {loaded}, micro-batch chosen {micro}; losses finite: {finite}"
    if ctx["cuda"]:
        ok = micro is not None and micro < loaded and finite
        detail += f"; cap {fraction:.3f} of the device's memory, restored to 1.0"
        row = _row(f"{name}(micro_batch_size='auto') under a memory cap", "PASS" if ok else "FAIL", detail)
    else:
        row = _row(f"{name}(micro_batch_size='auto') (no cap on CPU)", "INFO", detail + "; no change expected")
    return row, {**data, "loaded": loaded, "micro_batch_size": micro, "fraction": fraction}


CHECKS = {
    "fsdp": check_fsdp,
    "compile": check_compile,
    "fp8": check_fp8,
    "memory": check_memory,
    "micro_batch_auto": check_micro_batch_auto,
}
