"""Checks of ``gpu_check.py`` on training: AccelFSDP, compiled blocks, MemoryMonitor, ``micro_batch_size="auto"``.

Each ``check_*`` takes the script's ``ctx`` and returns ``(rows, data)``; what each one judges is in ``gpu_check.py``'s
docstring. The ViT fits are the shared arms of ``_gpu_arms``.
"""

from __future__ import annotations

import math
from typing import Any

import _common
import torch
import torch.nn.functional as F
from _gpu_arms import Row, build_vit, classifier, falls, fmt, make_trainer, release, row, vit_arm, vit_batch, vit_spec
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

# Compiled and eager kernels round bf16 differently (fusion, reduction order): 4 units of bf16's rounding (2**-8).
BF16_RTOL = 2.0**-6
LOSS_STEPS = 3  # the first losses compared between compiled and eager
_SPIKE_BYTES = 8 * 2**30  # well above ViT-B/16's peak at 32 images in bf16


# ------------------------------------------------------------------------------------------- 5. AccelFSDP


def check_fsdp(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    fsdp = vit_arm(ctx, "fsdp", "bf16-mixed", compiled=False)
    ddp = vit_arm(ctx, "ddp", "bf16-mixed", compiled=False)
    fl, dl = fsdp["losses"], ddp["losses"]
    # Falling, and by at least half as much as AccelDDP's run from the same weights on the same batch.
    ok = falls(fl) and fl[0] - fl[-1] >= 0.5 * (dl[0] - dl[-1])
    ratio = fsdp["images_per_s"] / ddp["images_per_s"]
    name = vit_spec(ctx)["model"]
    rows = [
        row(
            "AccelFSDP bf16-mixed trains (1 device)",
            "PASS" if ok else "FAIL",
            f"{name}: loss {fl[0]:.4g} -> {fl[-1]:.4g} in {len(fl)} steps on a fixed batch (AccelDDP"
            f" {dl[0]:.4g} -> {dl[-1]:.4g}); finite: {all(math.isfinite(v) for v in fl)}",
        ),
        row(
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
        row(
            f"AccelDDP(compile) {backend} vs eager images/s",
            speed,
            f"eager {eager['images_per_s']:,.1f}, compiled {comp['images_per_s']:,.1f} img/s: x{ratio:.2f}"
            f" (bf16-mixed, b={comp['batch']}); recompiles after warm-up: {fmt(comp['recompiles'], 'g')}",
        ),
        row(
            f"AccelDDP(compile) first {LOSS_STEPS} losses == eager",
            "PASS" if same else "FAIL",
            f"max relative difference {rel:.1e} (tolerance {BF16_RTOL:.1e}); eager"
            f" {', '.join(f'{v:.5g}' for v in first_e)}; compiled {', '.join(f'{v:.5g}' for v in first_c)}",
        ),
    ]
    return rows, {"eager": eager, "compiled": comp, "compiled_over_eager": ratio, "max_rel_loss_diff": rel}


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
    from lit_accel import AccelPrecision, EfficiencyMonitor, MemoryMonitor

    spec = {**vit_spec(ctx), "batch": 4 if ctx["dry_run"] else 32}
    monitor, probe = MemoryMonitor(print_summary=False), _ForwardAllocation(ctx)
    efficiency = EfficiencyMonitor(warmup_steps=0, print_summary=False)
    module = classifier(build_vit(spec), spec["lr"])
    spike_mb = 0.0
    if ctx["cuda"]:  # a process peak before the fit that the fit's own peak must not report (peaks restart per fit)
        spike = torch.empty(_SPIKE_BYTES, dtype=torch.uint8, device=ctx["device"])
        spike_mb = torch.cuda.max_memory_allocated(ctx["device"]) / 1e6
        del spike
        release(ctx)
    trainer = make_trainer(
        ctx, plugins=[AccelPrecision("bf16-mixed")], callbacks=[monitor, probe, efficiency], max_steps=2
    )
    trainer.fit(module, train_dataloaders=_common.RepeatBatch(vit_batch(spec, spec["batch"], ctx["device"]), 2))
    del trainer, module
    release(ctx)
    s = dict(monitor.summary)

    def get(name: str) -> float | None:
        return s.get(name, s.get(f"mem/{name}"))

    activations, casts, peak = get("activations_mb"), get("param_casts_mb"), get("peak_allocated_mb")
    # Both are held from the forward to the backward: the saved activations and autocast's saved weight copies.
    held = None if activations is None else activations + (casts or 0.0)
    grown = None if probe.after is None or probe.before is None else (probe.after - probe.before) / 1e6
    what = f"activations {fmt(activations, '.4g')} + param casts {fmt(casts, '.4g')} MB"
    if held is None:
        result, detail = "FAIL", f"no activations_mb in MemoryMonitor.summary (keys: {sorted(s)})"
    elif grown is None:
        result, detail = "INFO", f"{what}; CPU dry run: no CUDA allocator to compare with"
    else:
        ratio = held / grown
        result = "PASS" if abs(ratio - 1.0) <= 0.25 else "FAIL"
        detail = f"{what} = {held:.1f} MB vs memory_allocated +{grown:.1f} MB over the forward: x{ratio:.3f}"
    peak_row = (
        row(
            "MemoryMonitor peak_allocated_mb is this fit's",
            "PASS" if peak and peak < spike_mb else "FAIL",
            f"{fmt(peak, ',.1f')} MB; the process peaked at {spike_mb:,.1f} MB before the fit",
        )
        if ctx["cuda"]
        else row(
            "MemoryMonitor peak_allocated_mb is this fit's",
            "INFO",
            f"CPU dry run: {'absent' if peak is None else peak}",
        )
    )
    rows = [row(f"MemoryMonitor activations (bf16, b={spec['batch']})", result, detail), peak_row]
    if ctx["cuda"]:
        peak_gb = efficiency.summary.get("peak_memory_gb")
        ok = peak_gb is not None and 0 < peak_gb * 1e3 < spike_mb
        rows.append(row("EfficiencyMonitor peak_memory_gb is this fit's", "PASS" if ok else "FAIL", f"{peak_gb} GB"))
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
    release(ctx)
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
        line, data[name] = _micro_batch_auto(ctx, name, make)
        rows.append(line)
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
    trainer = make_trainer(ctx, strategy=strategy, plugins=[AccelPrecision("bf16-mixed")], max_steps=4)
    try:
        if budget is not None:
            release(ctx)
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
    release(ctx)
    detail = f"loaded {loaded}, micro-batch chosen {micro}; losses finite: {finite}"
    if ctx["cuda"]:
        ok = micro is not None and micro < loaded and finite
        detail += f"; cap {fraction:.3f} of the device's memory, restored to 1.0"
        line = row(f"{name}(micro_batch_size='auto') under a memory cap", "PASS" if ok else "FAIL", detail)
    else:
        line = row(f"{name}(micro_batch_size='auto') (no cap on CPU)", "INFO", detail + "; no change expected")
    return line, {**data, "loaded": loaded, "micro_batch_size": micro, "fraction": fraction}


CHECKS = {
    "fsdp": check_fsdp,
    "compile": check_compile,
    "memory": check_memory,
    "micro_batch_auto": check_micro_batch_auto,
}
