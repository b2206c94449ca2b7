"""The CUDA acceptance check of lit_accel: one script, under 8 minutes on one GPU, a short table printed last.

Nine checks, each a row (or a few) of the final table:

1. **fp16 loss scaling works on CUDA.** ``AccelPrecision("16-mixed", scaler=DynamicGradScaler(growth_interval=4))``
   trains a small regression
   MLP for 24 steps with an overflow injected at step 6 (the loss times inf), once with ``AdamW`` and once with
   ``AdamW(fused=True)`` (which skips on the device): exactly that step is skipped, the weights are bit-identical
   across it, the scale, growths and back-offs equal an independent simulation of the policy (torch's rule:
   x0.5 on overflow, x2 after ``growth_interval`` clean steps), ``LossScaleMonitor`` reports the same, and the loss
   falls. Plus the reason loss scaling exists: a gradient of 2**-30 per output flushes to zero in fp16 without
   scaling and is recovered (relative error < 1%) with the plugin's scale.
2. **lit_accel adds zero host-device syncs per steady-state step with a fused optimizer.** Steps 6-11 of a 14-step
   fit (no logging step, EfficiencyMonitor's warm-up over) run with ``torch.cuda.set_sync_debug_mode("warn")``; its
   warnings are counted, as are Python-level host reads of tensors (``.item()``, ``.tolist()``, ``bool()``, ...,
   through a ``TorchFunctionMode``) and ``torch.cuda.synchronize`` calls. Plain Lightning (``DDPStrategy`` +
   ``MixedPrecision``) and lit_accel (``AccelDDP`` + ``AccelPrecision`` + ``LossScaleMonitor`` +
   ``EfficiencyMonitor``) run the same model with ``AdamW(fused=True)``; lit_accel must add 0 per step in
   ``16-mixed`` and in ``bf16-mixed`` (``on_nonfinite="raise"``, whose flag travels to pinned host memory and is read
   a step later, and ``"skip"``). A positive control with a non-fused ``AdamW`` must show the 1 sync the
   ``AccelPrecision`` docstring documents there (``GradScaler`` reads the found-inf flag), so a 0 elsewhere is not a
   blind counter.
3. **ViT-B/16 throughput and MFU** in fp32 (TF32 off), bf16-mixed and 16-mixed through ``AccelPrecision``, fused AdamW,
   at ``--batch`` images (halved on out-of-memory; the largest that fits fp32 is used for all three), synthetic data
   already on the GPU. images/s from CUDA-synchronised wall time over the timed steps; MFU = FLOPs per image
   (``FlopCounterMode``, forward + backward) x images/s / the dense datasheet peak for the precision, and the
   ``EfficiencyMonitor``'s own MFU beside it. Mixed precision must beat fp32.
4. **SyncBN on CUDA uses torch's fused kernels and matches the portable path.** ``AccelSyncBatchNorm("auto")`` must
   resolve to ``torch.nn.SyncBatchNorm`` on CUDA + NCCL; then two processes (NCCL on two GPUs, or gloo sharing one
   GPU) run a BatchNorm2d training forward + backward three ways - torch's ``SyncBatchNorm``, lit_accel's portable
   one, and plain BatchNorm on the concatenated batch - and must agree (outputs, input and parameter gradients,
   running statistics), with the profiler showing ``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
   ``batch_norm_elemt``, ``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt`` in torch's run.

Checks 5-9 (in ``_gpu_checks_more.py``) train ViT-B/16 at ``min(--batch, 128)`` images with fused AdamW and
``AccelPrecision``, 3 warm-up and 10 timed steps on a fixed batch already on the GPU; each arm (strategy, precision,
compiled or not) is one fit, run once and shared by the checks that compare against it:

5. **AccelFSDP trains on one GPU.** ``AccelFSDP()`` (a world of one, FSDP2 over a one-device mesh) with
   ``bf16-mixed``: the loss is finite and falls, by at least half as much as ``AccelDDP``'s from the same weights;
   images/s against ``AccelDDP`` is reported.
6. **Compiled blocks are faster and train the same.** ``AccelDDP(compile=True)`` (inductor, each block compiled
   before DDP wraps it; compilation in the warm-up) against eager, ``bf16-mixed``: images/s must not drop, and the
   first 3 losses agree within 4 bf16 rounding units (relative 2**-6).
7. **FP8 is real and pays off.** ``AccelPrecision("fp8-mixed")`` (torchao float8) against ``bf16-mixed``, eager and
   compiled: images/s and the ``EfficiencyMonitor``'s MFU; ``float8_report`` must show converted layers on FP8 tensor
   cores (compute capability >= 8.9; emulated below, and on CPU) and finite losses; with compile, FP8 must beat bf16
   on such a GPU.
8. **MemoryMonitor's activations are what the allocator holds.** On a ``bf16-mixed`` fit at 32 images, the saved
   activations plus autocast's saved weight copies (``activations_mb + param_casts_mb``) are within 25% of the
   growth of ``torch.cuda.memory_allocated()`` from the first batch's start to its ``on_before_backward``, and
   ``peak_allocated_mb`` is reported.
9. **micro_batch_size="auto" finds a size that fits.** ``AccelDDP(global_batch_size=256, micro_batch_size="auto")``,
   then the same with ``AccelFSDP`` (its collectives kept in step through the failure by the ledger), with loaded
   batches of 256 under ``torch.cuda.set_per_process_memory_fraction``, set from a measured per-sample
   footprint so that 256 and 128 run out of memory and 64 fits: a change is recorded, the run finishes with a smaller
   micro-batch, and the fraction is restored to 1.0.

``--dry-run`` runs the same code on CPU with tiny shapes (gloo instead of NCCL, the host-read count instead of the CUDA
debug mode, no fused SyncBN kernels, no MFU without a peak, ``aot_eager`` instead of inductor, emulated FP8, no
allocator to compare with and no memory cap) so the script is known to work before GPU time is spent; what only a GPU
can judge is reported as INFO.
The exit code is 1 when a check fails.

Run (from the repository root)::

    python benchmarks/gpu_check.py                 # on a CUDA machine; writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --batch 256     # a smaller ViT-B/16 batch to start from
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check_dry.json   # CPU, ~1 minute
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
import warnings
from typing import Any

import _common
import _gpu_checks_more
import _gpu_checks_parallel
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

Row = dict[str, str]
FUSED_SYNCBN_OPS = (
    "aten::batch_norm_stats",
    "aten::batch_norm_gather_stats_with_counts",
    "aten::batch_norm_elemt",
    "aten::batch_norm_backward_reduce",
    "aten::batch_norm_backward_elemt",
)
# Tensor methods that read a tensor's values on the host: each is a host-device sync when the tensor is on a GPU.
# (``numpy()`` is not one: it only accepts CPU tensors, e.g. pinned host copies read without a sync.)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"}


def _row(check: str, result: str, detail: str) -> Row:
    return {"check": check, "result": result, "detail": detail}


def _trainer(ctx: dict[str, Any], **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    base = dict(
        accelerator="cuda" if ctx["cuda"] else "cpu",
        devices=1,
        **_common.QUIET_TRAINER,
    )
    base.update(kwargs)
    return pl.Trainer(**base)


def _mlp_module(ctx: dict[str, Any], fused: bool, lr: float, inject_at: int | None = None) -> Any:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.detach())
            if batch_idx == inject_at:
                loss = loss * float("inf")  # an overflow: inf/NaN gradients
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=fused)

    return Regression()


def _regression_batch(ctx: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) / 4.0  # unit variance: the initial loss is about 1
    return x.to(ctx["device"]), y.to(ctx["device"])


# ------------------------------------------------------------------------------------------- 1. fp16 loss scaling


def simulate_scale(steps: int, overflow_steps: set[int], init: float, growth_interval: int) -> tuple[float, int, int]:
    """torch's dynamic loss-scale rule (hysteresis 1): (final scale, growths, back-offs)."""
    scale, tracker, growths, backoffs = init, 0, 0, 0
    for step in range(steps):
        if step in overflow_steps:
            scale, tracker, backoffs = scale * 0.5, 0, backoffs + 1
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker, growths = scale * 2.0, 0, growths + 1
    return scale, growths, backoffs


def check_loss_scaling(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    from lightning.pytorch.callbacks import Callback

    from lit_accel import AccelPrecision, DynamicGradScaler, LossScaleMonitor

    # A low initial scale, so that the only overflow is the injected one (a run starting at 2**16 first backs off a
    # few times on its own while it calibrates; that is normal, but would blur what this check shows).
    steps, inject, interval, init = 24, 6, 4, 2.0**4
    rows, data = [], {}
    for fused in (False, True):

        class Snapshot(Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == inject:
                    self.before = [p.detach().clone() for p in pl_module.parameters()]

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx == inject:
                    self.after = [p.detach().clone() for p in pl_module.parameters()]

        snap = Snapshot()
        monitor = LossScaleMonitor(logging_interval=1, warmup_steps=0, skip_rate_threshold=None)
        plugin = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=init, growth_interval=interval))
        module = _mlp_module(ctx, fused=fused, lr=1e-2, inject_at=inject)
        trainer = _trainer(ctx, plugins=[plugin], callbacks=[snap, monitor], max_steps=steps)
        trainer.fit(module, train_dataloaders=_common.RepeatBatch(_regression_batch(ctx), steps))
        stats = plugin.scaler_stats()
        scale, skipped, growths, backoffs = torch.stack(
            [stats.scale.double(), stats.skipped_steps.double(), stats.growths.double(), stats.backoffs.double()]
        ).tolist()
        want_scale, want_growths, want_backoffs = simulate_scale(steps, {inject}, init, interval)
        losses = torch.stack(module.losses).tolist()
        unchanged = all(torch.equal(a, b) for a, b in zip(snap.before, snap.after))
        logged = monitor.last_metrics
        ok = (
            skipped == 1
            and unchanged
            and scale == want_scale
            and growths == want_growths
            and backoffs == want_backoffs
            and logged.get("amp/skipped_steps") == 1
            and logged.get("amp/loss_scale") == want_scale
            and losses[-1] < 0.5 * losses[0]
        )
        name = "AdamW(fused=True)" if fused else "AdamW"
        data[name] = dict(
            skipped=skipped, scale=scale, expected_scale=want_scale, growths=growths, expected_growths=want_growths,
            backoffs=backoffs, weights_unchanged_on_skip=unchanged, first_loss=losses[0], last_loss=losses[-1],
            monitor=logged,
        )  # fmt: skip
        rows.append(
            _row(
                f"fp16 loss scaling, {name}",
                "PASS" if ok else "FAIL",
                f"{skipped:.0f} skip at step {inject}, weights {'unchanged' if unchanged else 'CHANGED'}; scale"
                f" {scale:g} (sim {want_scale:g}), {growths:.0f}/{backoffs:.0f} growths/backoffs; loss"
                f" {losses[0]:.3g} -> {losses[-1]:.3g}",
            )
        )

    # Why it matters: an fp16 gradient of 2**-30 flushes to zero (smallest subnormal 2**-24) unless the loss is scaled.
    # Before a Trainer sets it up, the plugin autocasts on its `device` and reports the scale it will start from.
    plugin = AccelPrecision("16-mixed", device="cuda" if ctx["cuda"] else "cpu")
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(ctx["device"])
    x = torch.randn(32, 64, device=ctx["device"])
    tiny = 2.0**-30

    def weight_grad(scale: float, autocast: bool) -> torch.Tensor:
        lin.zero_grad(set_to_none=True)
        with plugin.forward_context() if autocast else contextlib.nullcontext():
            out = lin(x)
        (out.float().sum() * tiny * scale).backward()
        return lin.weight.grad.detach() / scale

    reference = weight_grad(1.0, autocast=False)
    unscaled = weight_grad(1.0, autocast=True)
    scaled = weight_grad(plugin.loss_scale, autocast=True)
    zero_frac = float((unscaled == 0).float().mean())
    rel_err = float((scaled - reference).norm() / reference.norm())
    ok = zero_frac == 1.0 and rel_err < 1e-2
    data["underflow"] = {"zero_fraction_unscaled": zero_frac, "relative_error_scaled": rel_err}
    rows.append(
        _row(
            "fp16 underflow rescued by scaling",
            "PASS" if ok else "FAIL",
            f"grad 2^-30: unscaled {zero_frac:.0%} zeros; scaled x{plugin.loss_scale:g}: rel. error {rel_err:.1e}",
        )
    )
    return rows, data


# ------------------------------------------------------------------------------------------- 2. host-device syncs


class _HostReadCounter(TorchFunctionMode):
    """Counts Python-level host reads of tensor values and records where they came from."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.sites: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.count += 1
            site = _caller_outside_torch()
            self.sites[f"{name} @ {site}"] = self.sites.get(f"{name} @ {site}", 0) + 1
        return func(*args, **(kwargs or {}))


def _caller_outside_torch() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "gpu_check.py" not in path:
            parts = path.split("/")
            return f"{'/'.join(parts[-3:])}:{frame.lineno}"
    return "?"


def _sync_window(ctx: dict[str, Any], start: int, stop: int) -> Any:
    """A callback counting syncs from the start of step ``start`` to the start of step ``stop``."""
    from lightning.pytorch.callbacks import Callback

    class SyncWindow(Callback):
        def __init__(self) -> None:
            self.debug_syncs = 0
            self.explicit_syncs = 0
            self.reads = _HostReadCounter()
            self._stack: contextlib.ExitStack | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == start:
                self._open()
            elif batch_idx == stop:
                self._close()

        def _open(self) -> None:
            stack = contextlib.ExitStack()
            self._records = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            original = torch.cuda.synchronize

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.explicit_syncs += 1
                return original(*args, **kwargs)

            torch.cuda.synchronize = counted
            stack.callback(setattr, torch.cuda, "synchronize", original)
            if ctx["cuda"]:
                torch.cuda.set_sync_debug_mode("warn")
                stack.callback(torch.cuda.set_sync_debug_mode, "default")
            stack.enter_context(self.reads)
            self._stack = stack

        def _close(self) -> None:
            assert self._stack is not None
            self._stack.close()
            self._stack = None
            self.debug_syncs = sum("synchroniz" in str(w.message) for w in self._records)

    return SyncWindow()


def _sync_arm(ctx: dict[str, Any], arm: str, precision: str, on_nonfinite: str, fused: bool) -> dict[str, Any]:
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor

    start, stop, steps = 6, 12, 14
    window = _sync_window(ctx, start, stop)
    device = "cuda" if ctx["cuda"] else "cpu"
    if arm == "lightning":
        strategy: Any = DDPStrategy()
        plugins: list[Any] = [MixedPrecision(precision, device=device)]
        callbacks = [window]
    else:
        strategy = AccelDDP()
        plugins = [AccelPrecision(precision, on_nonfinite=on_nonfinite)]  # type: ignore[arg-type]
        callbacks = [window, LossScaleMonitor(), EfficiencyMonitor(warmup_steps=3, print_summary=False)]
    trainer = _trainer(
        ctx, strategy=strategy, plugins=plugins, callbacks=callbacks, max_steps=steps, log_every_n_steps=50
    )
    module = _mlp_module(ctx, fused=fused, lr=1e-3)
    trainer.fit(module, train_dataloaders=_common.RepeatBatch(_regression_batch(ctx), steps))
    n = stop - start
    return {
        "debug_mode_syncs_per_step": window.debug_syncs / n if ctx["cuda"] else None,
        "host_reads_per_step": window.reads.count / n,
        "synchronize_calls_per_step": window.explicit_syncs / n,
        "host_read_sites": window.reads.sites,
    }


def check_syncs(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    rows, data = [], {}
    # (precision, on_nonfinite, fused, syncs lit_accel adds per step according to the AccelPrecision docstring). The
    # last is a positive control: the guard of a non-fused optimizer reads its found-inf flag on the host (documented
    # 1 sync), and the counter must see it - a count of 0 elsewhere then means something.
    configs = [
        ("16-mixed", "raise", True, 0),
        ("bf16-mixed", "raise", True, 0),
        ("bf16-mixed", "skip", True, 0),
        ("bf16-mixed", "raise", False, 1),
    ]
    what = "CUDA syncs" if ctx["cuda"] else "host reads (CPU stand-in)"
    key = "debug_mode_syncs_per_step" if ctx["cuda"] else "host_reads_per_step"
    for precision, on_nonfinite, fused, documented in configs:
        arms = {arm: _sync_arm(ctx, arm, precision, on_nonfinite, fused) for arm in ("lightning", "lit_accel")}
        added = arms["lit_accel"][key] - arms["lightning"][key]
        added_explicit = (
            arms["lit_accel"]["synchronize_calls_per_step"] - arms["lightning"]["synchronize_calls_per_step"]
        )
        label = f"{precision}, {'fused AdamW' if fused else 'AdamW (control)'}"
        if precision == "bf16-mixed":
            label += f", on_nonfinite='{on_nonfinite}'"
        data[label] = {**arms, "added_per_step": added, "added_synchronize_calls_per_step": added_explicit}
        result = "PASS" if added == documented and added_explicit == 0 else "FAIL"
        extra = ""
        if added > 0:
            base = arms["lightning"]["host_read_sites"]
            new = {s: c for s, c in arms["lit_accel"]["host_read_sites"].items() if c > base.get(s, 0)}
            extra = f"; new: {', '.join(sorted(new))}" if new else ""
        rows.append(
            _row(
                f"syncs/step, {label}",
                result,
                f"{what}: Lightning {arms['lightning'][key]:g}, lit_accel {arms['lit_accel'][key]:g} -> added"
                f" {added:g} (documented {documented}){extra}",
            )
        )
    return rows, data


# ------------------------------------------------------------------------------------------- 3. ViT throughput


def check_vit(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    import timm
    from lightning.pytorch.callbacks import Callback

    from lit_accel import AccelPrecision, EfficiencyMonitor
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
                _sync(ctx)
                self.start = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _sync(ctx)
            self.end = time.perf_counter()

    def run(precision: str, batch_size: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, 3, spec["img_size"], spec["img_size"], generator=g).to(device)
        y = torch.randint(0, 1000, (batch_size,), generator=g).to(device)
        clock = Clock()
        monitor = EfficiencyMonitor(warmup_steps=warmup, print_summary=False, peak_flops=ctx["peak"])
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        trainer = _trainer(
            ctx, plugins=[AccelPrecision(precision)], callbacks=[clock, monitor], max_steps=warmup + steps
        )
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
            _row(
                f"{spec['model']} b={batch} {name}",
                result,
                f"{r['images_per_s']:,.1f} img/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu}"
                f" (EfficiencyMonitor {'n/a' if mon is None else f'{mon:.1%}'}), x{speedup:.2f} vs fp32{mem}",
            )
        )
        r["speedup_vs_fp32"] = speedup
    return rows, {"model": spec, "batch": batch, "flops_per_image": flops_per_image, "device": device_name, **results}


def _sync(ctx: dict[str, Any]) -> None:
    if ctx["cuda"]:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- 4. SyncBatchNorm


def _syncbn_rank(rank: int, world_size: int, use_cuda: bool) -> dict[str, Any]:
    """One rank: torch's SyncBatchNorm, the portable one, and BatchNorm on the joint batch; returns the differences."""
    import torch.distributed as dist

    from lit_accel.plugins.layer_sync import AccelSyncBatchNorm

    backend = dist.get_backend()
    device = torch.device("cuda", rank if backend == "nccl" else 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(0)
    channels, per_rank = 8, 4
    x_all = (torch.randn(world_size * per_rank, channels, 6, 6, generator=g) * 3 + 1).to(device)
    up_all = torch.randn(x_all.shape, generator=g).to(device)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        return nn.Sequential(bn).to(device)

    # Reference: plain BatchNorm on the concatenated batch.
    ref = fresh()
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * up_all).sum().backward()
    out_ref_full, ref_bn = y_ref.detach(), ref[0]

    impls = ["portable"] + (["torch"] if use_cuda else [])
    out: dict[str, Any] = {}
    for impl in impls:
        model = fresh()
        plugin = AccelSyncBatchNorm(implementation=impl)  # type: ignore[arg-type]
        model = plugin.apply(model)
        x = x_all[sl].clone().requires_grad_()
        ops: set[str] = set()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if rank == 0 else None
        with profiler if profiler is not None else contextlib.nullcontext():
            y = model(x)
            (y * up_all[sl]).sum().backward()
        if profiler is not None:
            ops = {evt.key for evt in profiler.key_averages()}
        bn = model[0]
        grads = torch.cat([bn.weight.grad, bn.bias.grad])
        dist.all_reduce(grads)  # the joint-batch gradient is the sum of the ranks' contributions
        pairs = {
            "output": (y.detach(), out_ref_full[sl]),
            "input_grad": (x.grad, x_ref.grad[sl]),
            "param_grad": (grads, torch.cat([ref_bn.weight.grad, ref_bn.bias.grad])),
            "running_mean": (bn.running_mean, ref_bn.running_mean),
            "running_var": (bn.running_var, ref_bn.running_var),
        }
        # max |a - b| / max(1, max |b|): absolute for values of order 1, relative for large ones (summed gradients).
        diffs = {k: float((a - b).abs().max() / b.abs().max().clamp_min(1.0)) for k, (a, b) in pairs.items()}
        out[impl] = {
            "class": type(bn).__module__ + "." + type(bn).__name__,
            "max_abs_diff_vs_joint_batch": diffs,
            "fused_ops_seen": sorted(op for op in FUSED_SYNCBN_OPS if op in ops),
        }
    return out


def check_syncbn(ctx: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    import torch.distributed as dist

    from lit_accel.plugins.layer_sync import AccelSyncBatchNorm

    rows, data = [], {}
    # "auto" in this process, in a one-rank group (the sync check's Trainer may have created it already): NCCL on
    # CUDA must give torch's fused layer, gloo on CPU the portable one.
    if not dist.is_initialized():
        address = f"tcp://127.0.0.1:{_common.free_port()}"
        dist.init_process_group("nccl" if ctx["cuda"] else "gloo", init_method=address, rank=0, world_size=1)
    model = nn.Sequential(nn.BatchNorm2d(4)).to(ctx["device"])
    plugin = AccelSyncBatchNorm()
    model = plugin.apply(model)
    want = "torch" if ctx["cuda"] and dist.get_backend() == "nccl" else "portable"
    got = plugin.resolved_implementation
    data["auto_resolves_to"] = {"implementation": got, "class": type(model[0]).__name__}
    rows.append(
        _row(
            "SyncBN 'auto' implementation",
            "PASS" if got == want else "FAIL",
            f"{dist.get_backend()} on {ctx['device'].type}: {got} -> {type(model[0]).__name__} (expected {want})",
        )
    )
    backend = "nccl" if ctx["cuda"] and torch.cuda.device_count() >= 2 else "gloo"
    ranks = _common.launch(_syncbn_rank, 2, ctx["cuda"], backend=backend, timeout=300)
    tol = 1e-4
    for impl, r in ranks[0].items():
        worst = max(max(rk[impl]["max_abs_diff_vs_joint_batch"].values()) for rk in ranks)
        ok = worst < tol
        detail = f"{r['class']}, 2 ranks ({backend}): max normalised abs. diff. vs BN on joint batch {worst:.1e}"
        if impl == "torch":
            missing = [op for op in FUSED_SYNCBN_OPS if op not in r["fused_ops_seen"]]
            ok = ok and not missing
            detail += "; fused kernels: " + ("all 5 seen" if not missing else f"MISSING {missing}")
        rows.append(_row(f"SyncBN {impl} == BatchNorm(joint batch)", "PASS" if ok else "FAIL", detail))
        data[impl] = [rk[impl] for rk in ranks]
    if not ctx["cuda"]:
        rows.append(_row("SyncBN torch fused kernels", "n/a", "CPU dry run: torch.nn.SyncBatchNorm is CUDA-only"))
    data["backend"] = backend
    return rows, data


# ------------------------------------------------------------------------------------------- main


CHECKS = {
    "loss_scaling": check_loss_scaling,
    "syncs": check_syncs,
    "vit": check_vit,
    "syncbn": check_syncbn,
    **_gpu_checks_more.CHECKS,
    **_gpu_checks_parallel.CHECKS,
}


def _print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "INFO": "cyan", "n/a": "yellow"}
    for row in rows:
        table.add_row(row["check"], f"[{colors.get(row['result'], 'white')}]{row['result']}[/]", row["detail"])
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser("gpu_check", __doc__)
    p.add_argument("--dry-run", action="store_true", help="run on CPU with tiny shapes (no CUDA needed)")
    p.add_argument("--batch", type=_common.positive_int, default=512, help="ViT-B/16 batch to start from")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s for MFU (default: table)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    args = p.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if not checks or any(c not in CHECKS for c in checks):
        p.error(f"--checks {args.checks}: expected names from {', '.join(CHECKS)}")
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        p.error("CUDA is not available: run with --dry-run to exercise the script on CPU")
    _common.quiet()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = {
        "cuda": cuda,
        "dry_run": args.dry_run,
        "device": device,
        "batch": 4 if args.dry_run else args.batch,
        "peak": args.peak_tflops * 1e12 if args.peak_tflops else None,
    }
    machine = _common.machine_info()
    rows: list[Row] = []
    data: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for name in checks:
        start = time.perf_counter()
        try:
            new_rows, data[name] = CHECKS[name](ctx)
        except Exception as exc:  # a broken check must not hide the others' results
            new_rows = [_row(name, "FAIL", f"{type(exc).__name__}: {exc}"[:300])]
            data[name] = {"error": traceback.format_exc()}
        rows += new_rows
        timings[name] = round(time.perf_counter() - start, 1)
    failed = [r for r in rows if r["result"] == "FAIL"]
    result = {
        "benchmark": "gpu_check",
        "command": _common.command_line("gpu_check.py", argv),
        "mode": "dry-run (CPU)" if args.dry_run else "cuda",
        "machine": machine,
        "seconds_per_check": timings,
        "rows": rows,
        "details": data,
        "passed": not failed,
    }
    table = _common.markdown_table(
        ["check", "result", "detail"], [[r["check"], r["result"], r["detail"]] for r in rows]
    )
    _common.write_outputs(result, args.out, table)
    title = f"lit_accel gpu_check ({result['mode']}, {machine.get('gpu', machine['cpu'])}): " + (
        "all passed" if not failed else f"{len(failed)} FAILED"
    )
    _print_table(rows, title + f" in {sum(timings.values()):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
