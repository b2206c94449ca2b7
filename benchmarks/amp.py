"""Training throughput and memory of a ViT in fp32, bf16-mixed and 16-mixed.

One process trains the same ViT in full precision (Lightning's own plugin), with ``AccelPrecision("bf16-mixed")`` and
``AccelPrecision("16-mixed")`` (fp16 autocast with the dynamic loss scaler; on CPU this is real fp16, which plain
Lightning would silently turn into bf16), in interleaved repetitions (``fp32 bf16 fp16``, ``bf16 fp16 fp32``, ...).
Each repetition of an arm is one fresh fit from the same initial weights on the same pre-made batch (no data
loading in the measurement); the arm's value is images/s over ``--steps`` optimizer steps after ``--warmup`` steps
(host clock; on CUDA after a ``synchronize`` at both ends). The table gives the median and spread over ``--reps``
repetitions and the speed-up over fp32, measured repetition by repetition.

Memory: on CUDA, the peak of ``torch.cuda.max_memory_allocated`` during the arm's fits. On every device, the bytes of
the tensors autograd saves for the backward during one forward (``torch.autograd.graph.saved_tensors_hooks``, unique
storages): the activation memory that mixed precision halves; it is exact and independent of the allocator.

Speed: ``tflops`` is the model's matmul FLOPs per image (forward + backward, counted once by
``torch.utils.flop_counter.FlopCounterMode`` through ``lit_accel``'s ``measure_flops``) x images/s. ``mfu`` divides
it by the device's dense peak for the arm's matmul precision (``lit_accel.utilities._peak_flops``; fp32 runs with
TF32 *off*, so its peak is the fp32 one), or by ``--peak-tflops``; CPUs have no table entry.

On CPU the default is a CIFAR-sized ViT (timm ``vit_tiny_patch16_224`` at 32 px, patch 4, depth 6, 2.7 M parameters,
batch 32, one thread); on a GPU ViT-B/16 at 224 px (86 M parameters, batch 128). CPUs without native fp16 matrix
units run fp16 (and often bf16) *slower* than fp32: that is a property of the hardware, reported as measured.

Run (from the repository root)::

    python benchmarks/amp.py                             # writes benchmarks/results/amp.json (+ .md)
    python benchmarks/amp.py --device cuda --batch 256   # ViT-B/16 on a GPU
    python benchmarks/amp.py --tiny                      # a few seconds: checks that it runs
"""

from __future__ import annotations

import os
import time
from typing import Any

import _common
import torch
import torch.nn.functional as F
from torch import nn

ARMS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
MATMUL_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def build_net(args: Any) -> nn.Module:
    """The ViT of the run, with fixed initial weights."""
    import timm

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"num_classes": args.num_classes, "img_size": args.img_size}
    if args.patch_size is not None:
        kwargs["patch_size"] = args.patch_size
    if args.depth is not None:
        kwargs["depth"] = args.depth
    return timm.create_model(args.model, pretrained=False, **kwargs)


def saved_activation_bytes(net: nn.Module, plugin: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of the unique storages autograd saves for the backward during one forward of ``net``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = batch
    with plugin.forward_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(net(x), y)
    del loss
    return sum(seen.values())


def run_arm(arm: str, args: Any, batches: _common.RepeatBatch, device: torch.device) -> dict[str, Any]:
    """One fit of ``--warmup + --steps`` optimizer steps; returns images/s and memory."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    class Clock(Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == args.warmup:
                _sync(device)
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == args.warmup + args.steps - 1:
                _sync(device)
                self.end = time.perf_counter()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock()
    plugins = _common.precision_plugins(ARMS[arm])
    trainer = pl.Trainer(
        accelerator="cuda" if device.type == "cuda" else "cpu",
        devices=1,
        plugins=plugins,
        callbacks=[clock],
        max_steps=args.warmup + args.steps,
        **_common.QUIET_TRAINER,
    )
    module = _common.classifier(
        build_net(args), lambda params: torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    )
    trainer.fit(module, train_dataloaders=batches)
    out = {"images_per_s": args.batch * args.steps / (clock.end - clock.start)}
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    plugin = plugins[0] if plugins else trainer.precision_plugin  # fp32: Lightning's Precision, no autocast
    out["saved_activations_mb"] = saved_activation_bytes(module.net.to(device), plugin, batches.batch) / 1e6
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = _common.parser("amp", __doc__)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    p.add_argument("--model", default=None, help="timm model (cpu: vit_tiny_patch16_224, cuda: vit_base_patch16_224)")
    p.add_argument("--img-size", type=_common.positive_int, default=None, help="cpu: 32, cuda: 224")
    p.add_argument("--patch-size", type=_common.positive_int, default=None, help="cpu: 4, cuda: the model's (16)")
    p.add_argument("--depth", type=_common.positive_int, default=None, help="cpu: 6, cuda: the model's (12)")
    p.add_argument("--num-classes", type=_common.positive_int, default=10, help="classifier outputs")
    p.add_argument("--batch", type=_common.positive_int, default=None, help="images per step (cpu 32, cuda 128)")
    p.add_argument("--steps", type=_common.positive_int, default=None, help="timed steps per fit (cpu 8, cuda 20)")
    p.add_argument("--warmup", type=_common.positive_int, default=None, help="untimed steps per fit (cpu 2, cuda 5)")
    p.add_argument("--reps", type=_common.positive_int, default=3, help="interleaved repetitions")
    p.add_argument("--threads", type=_common.positive_int, default=1, help="CPU intra-op threads")
    p.add_argument("--arms", default="fp32,bf16,fp16", help="comma-separated, from fp32, bf16, fp16")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s per precision for MFU")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms) or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: expected distinct names from {', '.join(ARMS)}")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    defaults = (
        {"model": "vit_base_patch16_224", "img_size": 224, "batch": 128, "steps": 20, "warmup": 5}
        if cuda
        else {"model": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 4, "depth": 6, "batch": 32,
              "steps": 8, "warmup": 2}
    )  # fmt: skip
    if args.tiny:
        defaults.update(model="vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, batch=4, steps=2, warmup=1)
        args.reps = 1
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)

    _common.quiet()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # Lightning changes torch's threads unless this is set
    torch.set_num_threads(args.threads)
    if cuda:  # fp32 means fp32: no TF32 tensor cores in the baseline
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    from lit_accel.callbacks._flops import measure_flops
    from lit_accel.utilities._peak_flops import lookup_peak_flops

    machine = _common.machine_info()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=g)
    y = torch.randint(0, args.num_classes, (args.batch,), generator=g)
    batch = (x.to(device), y.to(device))
    batches = _common.RepeatBatch(batch, args.warmup + args.steps)

    probe = build_net(args).to(device)
    flops_per_image = measure_flops(lambda: F.cross_entropy(probe(batch[0][:2]), batch[1][:2]).backward()) / 2
    n_params = sum(p.numel() for p in probe.parameters())
    probe = None  # free it before the measured fits

    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    start = time.perf_counter()
    for rep in range(args.reps):
        for arm in _common.rotated(args.arms, rep):
            results[arm].append(run_arm(arm, args, batches, device))
    wall = time.perf_counter() - start

    device_name = torch.cuda.get_device_name(device) if cuda else machine["cpu"]
    base = results.get("fp32")
    arms: dict[str, Any] = {}
    rows = []
    for arm in args.arms:
        ips = [r["images_per_s"] for r in results[arm]]
        entry: dict[str, Any] = {
            "precision": ARMS[arm],
            "images_per_s": _common.summarize(ips, 2),
            "saved_activations_mb": round(results[arm][-1]["saved_activations_mb"], 2),
        }
        median_ips = entry["images_per_s"]["median"]
        entry["tflops"] = round(flops_per_image * median_ips / 1e12, 4)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else lookup_peak_flops(device_name, MATMUL_PRECISION[arm])
        entry["peak_tflops"] = None if peak is None else peak / 1e12
        entry["mfu"] = None if peak is None else round(flops_per_image * median_ips / peak, 4)
        if cuda:
            entry["peak_memory_gb"] = round(max(r["peak_memory_gb"] for r in results[arm]), 3)
        if base is not None:
            speedups = _common.paired_ratios(ips, [r["images_per_s"] for r in base])
            entry["speedup_vs_fp32"] = _common.summarize(speedups, 3)
        arms[arm] = entry
        rows.append([
            arm, f"{median_ips:.2f}", f"{entry['images_per_s']['q1']:.2f}-{entry['images_per_s']['q3']:.2f}",
            f"{entry['speedup_vs_fp32']['median']:.3f}" if "speedup_vs_fp32" in entry else "",
            f"{entry['tflops']:.3f}", "n/a" if entry["mfu"] is None else f"{entry['mfu']:.1%}",
            f"{entry['peak_memory_gb']:.2f}" if cuda else "n/a (CPU)", f"{entry['saved_activations_mb']:.1f}",
        ])  # fmt: skip
    result = {
        "benchmark": "amp",
        "command": _common.command_line("amp.py", argv),
        "machine": machine,
        "load_average_after": _common.load_average(),
        "wall_s": round(wall, 1),
        "setup": {
            "device": device_name,
            "model": args.model,
            "img_size": args.img_size,
            "patch_size": args.patch_size,
            "depth": args.depth,
            "parameters": n_params,
            "batch": args.batch,
            "threads": args.threads if not cuda else None,
            "tf32": False if cuda else None,
            "optimizer": "AdamW(fused)" if cuda else "AdamW(foreach)",
            "flops_per_image_fwd_bwd": flops_per_image,
            "timed_steps_per_rep": args.steps,
            "warmup_steps_per_rep": args.warmup,
            "reps": args.reps,
        },
        "arms": arms,
    }
    table = _common.markdown_table(
        ["arm", "median images/s", "IQR", "speed-up vs fp32", "TFLOP/s", "MFU", "peak memory (GB)",
         "saved activations (MB)"],
        rows,
    )  # fmt: skip
    _common.write_outputs(result, args.out, table)
    return result


if __name__ == "__main__":
    main()
