"""Dense peak FLOP/s of accelerators, by device name and matmul precision, for model FLOPs utilisation (MFU).

Every figure is the **dense** (no 2:4 structured sparsity) tensor-core peak from the vendor's datasheet or
architecture whitepaper, in TFLOP/s per device. NVIDIA datasheets print the with-sparsity figure for the tensor
formats (marked ``*``); the dense figure is half of it. Mixing the two is the bug of Lightning's table
(Lightning-AI/pytorch-lightning#21677), which also has no entry for H200 (as named by the driver) or B200 and gives
L4's figure for L40S.

Precisions: ``"fp32"`` (CUDA cores, no tensor cores), ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``. PyTorch's matmuls
accumulate in fp32, so for GeForce cards, whose tensor cores run fp16/bf16 *with fp32 accumulate* at half the rate
of fp16 accumulate, the fp32-accumulate figure is used (NVIDIA Ampere GA102 whitepaper, Appendix A; Ada whitepaper,
Appendix A). Professional and data-centre cards run both at full rate.

Datasheet peaks are at boost clock; real matmuls reach less (one H200 here measured 788 TFLOP/s on an 8192^3 bf16
matmul against the 989.5 below), so an MFU of 60-80% of these figures is already excellent.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["PEAK_TFLOPS", "MatmulPrecision", "lookup_peak_flops", "matmul_precision"]

MatmulPrecision = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "fp64"]

# Keys are device-name tokens (see `_tokens`); an entry matches when its tokens appear contiguously in the device
# name. Longer keys are tried first, so "h100 nvl" wins over "h100", and tokens are compared whole, so "a10" never
# matches "a100" and "l4" never matches "l40s".
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # --- Blackwell ---
    # HGX B200 datasheet (per GPU, 1000 W): FP32 75, TF32 2.2 PF*, FP16/BF16 4.5 PF*, FP8 9 PF* (* = sparse). The
    # per-GPU TF32 figure is rounded: the 8-GPU total is 18 PF*, i.e. 2.25 PF* and 1,125 dense per GPU.
    "b200": {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    # GB200 NVL72 datasheet (per Blackwell GPU, 1200 W): FP32 80, TF32 2.5 PF*, FP16/BF16 5 PF*, FP8 10 PF*.
    "gb200": {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0},
    # --- Hopper ---
    # H200 datasheet (SC23), SXM: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*. The driver names it "NVIDIA H200".
    "h200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    # H200 NVL: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
    "h200 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # H100 datasheet, SXM5 (driver: "NVIDIA H100 80GB HBM3"): same tensor peaks as H200 SXM.
    "h100": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    # H100 PCIe: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*.
    "h100 pcie": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    # H100 NVL (current per-GPU datasheet): FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
    "h100 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # GH200 datasheet: the Hopper GPU has the H100 SXM tensor peaks (FP8 3,958*, BF16 1,979*).
    "gh200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    # --- Ada Lovelace ---
    # L40S datasheet: FP32 91.6, TF32 183 | 366*, BF16/FP16 362.05 | 733*, FP8 733 | 1,466*. (The datasheet's dense
    # BF16 is 1.2% below half its sparse figure; we keep the printed dense value.)
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    # L40 datasheet: FP32 90.5, TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*, FP8 362 | 724*.
    "l40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362.0},
    # L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*.
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
    # RTX 6000 Ada datasheet / Ada whitepaper: FP32 91.1, TF32 182.1, FP16/BF16 (fp32 acc) 364.2, FP8 728.5 (dense).
    "rtx 6000 ada": {"fp32": 91.1, "tf32": 182.1, "bf16": 364.2, "fp16": 364.2, "fp8": 728.5},
    # GeForce RTX 4090, Ada whitepaper Appendix A: FP32 82.6; TF32 82.6/165.2; FP16 and BF16 with FP32 accumulate
    # 165.2/330.4 (330.3 with FP16 accumulate); FP8 with FP32 accumulate 330.3/660.6.
    "rtx 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
    # --- Ampere ---
    # A100 datasheet (SXM4 and PCIe, 40 and 80 GB alike): FP32 19.5, TF32 156, BF16/FP16 312 (dense).
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # A10 datasheet: FP32 31.2, TF32 62.5 | 125*, BF16/FP16 125 | 250*.
    "a10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    # A10G (AWS G5): NVIDIA publishes no datasheet. Figures as reported by AWS/NVIDIA spec listings (e.g. Baseten,
    # "NVIDIA A10 vs A10G", 2023): FP32 31.52, TF32 35, BF16/FP16 70 dense. Lower confidence than the rest;
    # pass `peak_flops=` if you know better.
    "a10g": {"fp32": 31.52, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0},
    # A40 datasheet: FP32 37.4, TF32 74.8 | 149.6*, BF16/FP16 (fp32 acc) 149.7 | 299.4*.
    "a40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    # RTX A6000, GA102 whitepaper Appendix C: FP32 38.7, TF32 77.4, BF16/FP16 (fp32 acc) 154.8 (dense).
    "rtx a6000": {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8},
    # GeForce RTX 3090, GA102 whitepaper Appendix A: FP32 35.6; TF32 35.6/71; FP16 and BF16 with FP32 accumulate
    # 71/142 (142 with FP16 accumulate).
    "rtx 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    # --- Volta / Turing (no bf16 or tf32 tensor cores) ---
    # V100 datasheet: SXM2 FP32 15.7, tensor (fp16, fp32 acc) 125; PCIe 14 / 112; V100S PCIe 16.4 / 130.
    # Driver names: "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB". The SXM3 part of DGX-2
    # has its own clocks and no entry.
    "v100 sxm2": {"fp32": 15.7, "fp16": 125.0},
    "v100 pcie": {"fp32": 14.0, "fp16": 112.0},
    "v100s": {"fp32": 16.4, "fp16": 130.0},
    # T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65.
    "t4": {"fp32": 8.1, "fp16": 65.0},
}

# A token right after a matched key that names a different product ("RTX 4090 D", "RTX 3090 Ti", "4090 Laptop GPU"):
# such devices are not the entry and get no figure rather than a wrong one.
_VARIANT_TOKENS = frozenset({"ti", "super", "d", "laptop", "mobile", "max", "maxq"})


def _tokens(name: str) -> list[str]:
    return name.lower().replace("-", " ").replace("_", " ").split()


def lookup_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at one matmul precision, or ``None`` when unknown.

    Args:
        device_name: the name the driver reports, e.g. ``torch.cuda.get_device_name()`` ("NVIDIA H100 PCIe").
        precision: one of ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``.

    Returns:
        FLOP/s (not TFLOP/s), or ``None`` when the device is not in the table or has no figure for the precision
        (V100 has no bf16 tensor cores; the table keeps no fp64 figures), and for a MIG slice ("... MIG 1g.10gb"),
        which has only a fraction of the GPU's compute: pass the slice's own peak.

    Example::

        >>> lookup_peak_flops("NVIDIA H100 NVL", "bf16")
        835500000000000.0
    """
    tokens = _tokens(device_name)
    if "mig" in tokens:
        return None
    for key in sorted(PEAK_TFLOPS, key=lambda k: -len(k.split())):
        key_tokens = key.split()
        n = len(key_tokens)
        for start in range(len(tokens) - n + 1):
            if tokens[start : start + n] != key_tokens:
                continue
            following = tokens[start + n] if start + n < len(tokens) else None
            if following in _VARIANT_TOKENS:
                continue
            tflops = PEAK_TFLOPS[key].get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def matmul_precision(trainer_precision: str | int | None) -> MatmulPrecision:
    """The precision the run's matmuls execute in, from Lightning's ``trainer.precision`` string.

    ``"bf16-mixed"``/``"bf16-true"`` -> ``"bf16"``; ``"16-mixed"``/``"16-true"`` -> ``"fp16"``;
    ``"transformer-engine*"`` -> ``"fp8"``; ``"64-true"`` -> ``"fp64"``; ``"32-true"`` -> ``"tf32"`` when PyTorch is
    allowed to run fp32 matmuls on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32`` or
    ``torch.get_float32_matmul_precision() != "highest"``), else ``"fp32"``.

    Args:
        trainer_precision: the value of ``trainer.precision`` (``None`` is read as ``"32-true"``).

    Returns:
        The matmul precision key of :data:`PEAK_TFLOPS`.
    """
    p = str(trainer_precision if trainer_precision is not None else "32-true").lower()
    if p.startswith("transformer-engine"):
        return "fp8"
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("64"):
        return "fp64"
    if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"
