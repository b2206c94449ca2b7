"""Checks 1-2 of ``gpu_check.py`` (documented there): fp16 loss scaling on CUDA, and the host-device syncs per step.

Each ``check_*`` takes the script's ``ctx`` and returns ``(rows, data)``.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from typing import Any

import _common
import torch
import torch.nn.functional as F
from _gpu_arms import Row, make_trainer, row
from torch import nn
from torch.overrides import TorchFunctionMode

# Tensor methods that read a tensor's values on the host: each is a host-device sync when the tensor is on a GPU.
# (``numpy()`` is not one: it only accepts CPU tensors, e.g. pinned host copies read without a sync.)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"}


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
        trainer = make_trainer(ctx, plugins=[plugin], callbacks=[snap, monitor], max_steps=steps)
        trainer.fit(module, train_dataloaders=_common.RepeatBatch(_regression_batch(ctx), steps))
        stats = plugin.scaler.scaler_stats()
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
            row(
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
        row(
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
        if "/torch/" not in path and "gpu_check" not in path:
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


def _sync_arm(ctx: dict[str, Any], arm: str, precision: str, action: str, fused: bool) -> dict[str, Any]:
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from lit_accel import AccelDDP, AccelPrecision, EfficiencyMonitor, LossScaleMonitor, NonFiniteGuard

    start, stop, steps = 6, 12, 14
    window = _sync_window(ctx, start, stop)
    device = "cuda" if ctx["cuda"] else "cpu"
    if arm == "lightning":
        strategy: Any = DDPStrategy()
        plugins: list[Any] = [MixedPrecision(precision, device=device)]
        callbacks = [window]
    else:
        strategy = AccelDDP()
        plugins = [AccelPrecision(precision)]  # type: ignore[arg-type]
        callbacks = [window, LossScaleMonitor(), EfficiencyMonitor(warmup_steps=3, print_summary=False)]
        if precision != "16-mixed":  # the guard of bf16 (fp16's scaler checks its own steps)
            callbacks.append(NonFiniteGuard(action=action))  # type: ignore[arg-type]
    trainer = make_trainer(
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
    # (precision, NonFiniteGuard action, fused, syncs lit_accel adds per step according to docs/precision.md). The
    # last is a positive control: the guard of a non-fused optimizer reads its flag on the host (documented 1 sync),
    # and the counter must see it - a count of 0 elsewhere then means something.
    configs = [
        ("16-mixed", "raise", True, 0),
        ("bf16-mixed", "raise", True, 0),
        ("bf16-mixed", "skip", True, 0),
        ("bf16-mixed", "raise", False, 1),
    ]
    what = "CUDA syncs" if ctx["cuda"] else "host reads (CPU stand-in)"
    key = "debug_mode_syncs_per_step" if ctx["cuda"] else "host_reads_per_step"
    for precision, action, fused, documented in configs:
        arms = {arm: _sync_arm(ctx, arm, precision, action, fused) for arm in ("lightning", "lit_accel")}
        added = arms["lit_accel"][key] - arms["lightning"][key]
        added_explicit = (
            arms["lit_accel"]["synchronize_calls_per_step"] - arms["lightning"]["synchronize_calls_per_step"]
        )
        label = f"{precision}, {'fused AdamW' if fused else 'AdamW (control)'}"
        if precision == "bf16-mixed":
            label += f", NonFiniteGuard(action='{action}')"
        data[label] = {**arms, "added_per_step": added, "added_synchronize_calls_per_step": added_explicit}
        result = "PASS" if added == documented and added_explicit == 0 else "FAIL"
        extra = ""
        if added > 0:
            base = arms["lightning"]["host_read_sites"]
            new = {s: c for s, c in arms["lit_accel"]["host_read_sites"].items() if c > base.get(s, 0)}
            extra = f"; new: {', '.join(sorted(new))}" if new else ""
        rows.append(
            row(
                f"syncs/step, {label}",
                result,
                f"{what}: Lightning {arms['lightning'][key]:g}, lit_accel {arms['lit_accel'][key]:g} -> added"
                f" {added:g} (documented {documented}){extra}",
            )
        )
    return rows, data


CHECKS = {"loss_scaling": check_loss_scaling, "syncs": check_syncs}
