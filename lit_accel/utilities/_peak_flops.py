"""Dense peak FLOP/s of accelerators by device and precision, and the precision-aware MFU arithmetic.

Every figure is the **dense** (no 2:4 structured sparsity) tensor-core peak from the vendor's datasheet or
architecture whitepaper, in TFLOP/s per device. NVIDIA datasheets print the with-sparsity figure for the tensor
formats (marked ``*``); the dense figure is half of it. Mixing the two is the bug of Lightning's table
(Lightning-AI/pytorch-lightning#21677), which also has no entry for H200 (as named by the driver) or B200 and gives
L4's figure for L40S. Precisions: ``"fp32"`` (CUDA cores), ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``
(FP64 tensor cores, which cuBLAS uses for float64 matmuls). PyTorch's matmuls accumulate in fp32, so for GeForce
cards, whose tensor cores run fp16/bf16 *with fp32 accumulate* at half the fp16-accumulate rate, that figure is used
(Ampere GA102 whitepaper, Appendix A; Ada whitepaper, Appendix A). Datasheet peaks are at boost clock; real matmuls
reach less (one H200 here ran an 8192^3 bf16 matmul at 788 TFLOP/s against 989.5), so 60-80% MFU is excellent.

**MFU under mixed precision.** PaLM (Chowdhery et al. 2022, appendix B) defines MFU = achieved model FLOP/s / peak
FLOP/s. When one step runs FLOPs in several formats (a bf16 body, an fp32 head, fp8 linears), one peak is wrong for
all of them (torchtitan turns MFU off under FP8: pytorch/torchtitan#560). We split the count by dtype
(``lit_accel.callbacks._flops``) and compare time instead (the split is ours)::

    ideal_seconds = sum over dtypes d of flops_d / peak_d      MFU = ideal_seconds / measured_seconds

the share of the measured time that a device running every format at its dense peak would need. With one dtype it
is PaLM's ``flops / (peak x seconds)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lit_accel.utilities._units import format_flops_per_second, format_percent, format_seconds

__all__ = [
    "PEAK_TFLOPS",
    "DeviceFacts",
    "Estimate",
    "MatmulPrecision",
    "PeakLookup",
    "cuda_device_facts",
    "fp32_uses_tf32",
    "ideal_seconds",
    "lookup_peak_flops",
    "lookup_peaks",
    "matmul_precision",
    "mfu",
]

MatmulPrecision = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "fp64"]

# Entry -> dense TFLOP/s. Which driver names map to which entry: `_NAMES` and `_h100`/`_h200` below.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # --- Blackwell ---
    # HGX B200 datasheet (per GPU, 1000 W): FP32 75, TF32 2.2 PF*, FP16/BF16 4.5 PF*, FP8 9 PF* (* = sparse). The
    # per-GPU TF32 figure is rounded: the 8-GPU total is 18 PF*, i.e. 2.25 PF* and 1,125 dense per GPU.
    "b200": {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    # GB200 NVL72 datasheet (per Blackwell GPU, 1200 W): FP32 80, TF32 2.5 PF*, FP16/BF16 5 PF*, FP8 10 PF*.
    "gb200": {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0},
    # --- Hopper ---
    # H200 datasheet (SC23), SXM (141 GB, up to 700 W): FP64 tensor 67, FP32 67, TF32 989*, BF16/FP16 1,979*,
    # FP8 3,958*. NVL (141 GB, up to 600 W): FP64 tensor 60, FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
    "h200 sxm": {"fp64": 67.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    "h200 nvl": {"fp64": 60.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # H100 datasheet: SXM5 (80 GB HBM3, up to 700 W) has the H200 SXM's compute; PCIe (80 GB HBM2e, 114 SMs,
    # 300-350 W): FP64 tensor 51, FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*; NVL (94 GB HBM3, 350-400 W):
    # FP64 tensor 60, FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
    "h100 sxm": {"fp64": 67.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    "h100 pcie": {"fp64": 51.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    "h100 nvl": {"fp64": 60.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # GH200 datasheet: the Hopper GPU has the H100 SXM tensor peaks (FP64 tensor 67, BF16 1,979*, FP8 3,958*).
    "gh200": {"fp64": 67.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
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
    # A100 datasheet (SXM4 and PCIe, 40 and 80 GB alike): FP64 tensor 19.5, FP32 19.5, TF32 156, BF16/FP16 312.
    "a100": {"fp64": 19.5, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
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

# Device-name tokens (see `_tokens`) -> entry. A key matches when its tokens appear contiguously in the name; longer
# keys are tried first ("h100 nvl" before "h100"), and whole tokens are compared, so "a10" never matches "a100" and
# "l4" never "l40s". Driver names: "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100
# PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA GH200 480GB", "NVIDIA L40S".
_NAMES = {key: key for key in PEAK_TFLOPS if not key.startswith(("h100", "h200"))}
_NAMES |= {"h200 nvl": "h200 nvl", "h200 pcie": "h200 nvl", "h100 nvl": "h100 nvl", "h100 pcie": "h100 pcie"}
_NAMES |= {"h100 sxm": "h100 sxm", "h100 sxm5": "h100 sxm"}
# A token right after a matched key that names a different product ("RTX 4090 D", "RTX 3090 Ti", "4090 Laptop GPU"):
# such devices are not the entry and get no figure rather than a wrong one.
_VARIANT_TOKENS = frozenset({"ti", "super", "d", "laptop", "mobile", "max", "maxq"})
_GIB = 2**30


def _tokens(name: str) -> list[str]:
    return name.lower().replace("-", " ").replace("_", " ").split()


@dataclass(frozen=True)
class PeakLookup:
    """Which peak-table entry a device maps to, its dense peaks, and why.

    Attributes:
        entry: the :data:`PEAK_TFLOPS` key used, or ``None`` when the device is unknown (or a MIG slice).
        peaks: dense peak FLOP/s (not TFLOP/s) by precision; empty when ``entry`` is ``None``.
        reason: the matched name tokens and the fact that decided between variants, or why nothing matched.
    """

    entry: str | None
    peaks: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class DeviceFacts:
    """What identifies a GPU variant besides its name: all optional (see :func:`lookup_peaks`)."""

    name: str
    memory_bytes: int | None = None
    sm_count: int | None = None
    power_limit_w: float | None = None

    def lookup(self) -> PeakLookup:
        """:func:`lookup_peaks` with these facts."""
        return lookup_peaks(
            self.name, memory_bytes=self.memory_bytes, power_limit_w=self.power_limit_w, sm_count=self.sm_count
        )


def _h100(tokens: list[str], facts: DeviceFacts) -> tuple[str, str]:
    """The H100 form factor when the name does not say it ("NVIDIA H100", "NVIDIA H100 80GB HBM3")."""
    if "hbm3" in tokens and "80gb" in tokens:
        return "h100 sxm", "'80GB HBM3': the SXM5 module (PCIe has HBM2e, NVL 94 GB)"
    if facts.sm_count == 114:
        return "h100 pcie", "114 SMs: the PCIe card (SXM5 and NVL have 132)"
    if facts.power_limit_w is not None:
        watts = f"{facts.power_limit_w:.0f} W power limit"
        if facts.power_limit_w > 450:
            return "h100 sxm", f"{watts}: SXM5 (up to 700 W; PCIe 350 W, NVL 400 W)"
        if facts.memory_bytes is not None:
            gib = facts.memory_bytes / _GIB
            if gib > 86:
                return "h100 nvl", f"{watts} + {gib:.0f} GiB: NVL (400 W, 94 GB)"
            return "h100 pcie", f"{watts} + {gib:.0f} GiB: PCIe (350 W, 80 GB)"
        return "h100 nvl", f"{watts}: PCIe or NVL; assumed NVL, the higher peak (pass memory_bytes to tell)"
    return "h100 sxm", "form factor unknown; assumed SXM5, the highest H100 peak (pass power_limit_w to tell)"


def _h200(tokens: list[str], facts: DeviceFacts) -> tuple[str, str]:
    """Plain "NVIDIA H200" is the SXM part; a power limit of at most 600 W (the NVL's maximum) says NVL."""
    memory = "" if facts.memory_bytes is None else f" + {facts.memory_bytes / _GIB:.0f} GiB"
    if facts.power_limit_w is not None and facts.power_limit_w <= 650:
        return "h200 nvl", f"{facts.power_limit_w:.0f} W power limit{memory}: NVL (up to 600 W; SXM up to 700 W)"
    watts = "" if facts.power_limit_w is None else f" + {facts.power_limit_w:.0f} W"
    return "h200 sxm", f"the driver's name for the SXM part (141 GB, up to 700 W){memory}{watts}"


_AMBIGUOUS = {"h100": _h100, "h200": _h200}


def lookup_peaks(
    device_name: str,
    *,
    memory_bytes: int | None = None,
    power_limit_w: float | None = None,
    sm_count: int | None = None,
) -> PeakLookup:
    """The peak-table entry of a device, by its driver name and, where the name is ambiguous, by other facts.

    Example::

        >>> lookup_peaks("NVIDIA H200", power_limit_w=700).entry
        'h200 sxm'

    Args:
        device_name: the name the driver reports (``torch.cuda.get_device_name()``).
        memory_bytes: ``torch.cuda.get_device_properties(i).total_memory``.
        power_limit_w: the board's *default* power limit in W (NVML ``nvmlDeviceGetPowerManagementDefaultLimit``),
            not a limit an administrator lowered: it tells H200 NVL from SXM and H100 SXM from PCIe/NVL.
        sm_count: ``torch.cuda.get_device_properties(i).multi_processor_count`` (114 on an H100 PCIe).

    Returns:
        A :class:`PeakLookup`; its ``entry`` is ``None`` for unknown devices and MIG slices, which have only a
        fraction of the GPU's compute (pass the slice's own peak).
    """
    facts = DeviceFacts(device_name, memory_bytes, sm_count, power_limit_w)
    tokens = _tokens(device_name)
    if "mig" in tokens:
        return PeakLookup(None, reason=f"{device_name!r} is a MIG slice, a fraction of the GPU: pass its own peak")
    variant = ""
    for key in sorted(_NAMES.keys() | _AMBIGUOUS.keys(), key=lambda k: (-len(k.split()), k)):
        n = len(key.split())
        for start in range(len(tokens) - n + 1):
            if tokens[start : start + n] != key.split():
                continue
            following = tokens[start + n] if start + n < len(tokens) else None
            if following in _VARIANT_TOKENS:
                variant = variant or f": {key!r} followed by {following!r} is another product"
                continue
            entry, why = _AMBIGUOUS[key](tokens, facts) if key in _AMBIGUOUS else (_NAMES[key], "")
            peaks = {p: tflops * 1e12 for p, tflops in PEAK_TFLOPS[entry].items()}
            return PeakLookup(entry, peaks, f"name {device_name!r} (tokens {key!r})" + (f": {why}" if why else ""))
    return PeakLookup(None, reason=f"{device_name!r} matches no entry of the peak table{variant}")


def lookup_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at one precision, or ``None`` when unknown; name-only :func:`lookup_peaks`.

    Example::

        >>> lookup_peak_flops("NVIDIA H100 NVL", "bf16")
        835500000000000.0
    """
    return lookup_peaks(device_name).peaks.get(precision)


def _nvml_default_power_limit_w(props: Any) -> float | None:
    try:
        import pynvml  # nvidia-ml-py, optional (torch.cuda.power_draw uses it too)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        # By PCI address: NVML's device indices ignore CUDA_VISIBLE_DEVICES.
        bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0
    except pynvml.NVMLError:
        return None


def cuda_device_facts(index: int) -> DeviceFacts:
    """Name, memory and SM count of a CUDA device from torch, and its default power limit if NVML answers.

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(f"cuda_device_facts({index}): CUDA is not available. Fix: call it on a CUDA machine.")
    props = torch.cuda.get_device_properties(index)
    power = _nvml_default_power_limit_w(props)
    return DeviceFacts(props.name, props.total_memory, props.multi_processor_count, power)


def fp32_uses_tf32(kind: Literal["matmul", "conv"]) -> bool:
    """Whether PyTorch lets float32 matmuls (or cuDNN convolutions) run on TF32 tensor cores.

    Reads the ``fp32_precision`` switches (torch >= 2.9), which the legacy ``allow_tf32`` flags and
    ``torch.set_float32_matmul_precision`` also set; reading the legacy flags raises once the new API was used.
    """
    backend = torch.backends.cuda.matmul if kind == "matmul" else getattr(torch.backends.cudnn, "conv", None)
    precision = getattr(backend, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    if kind == "conv":
        return bool(torch.backends.cudnn.allow_tf32)
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def matmul_precision(trainer_precision: str | int | None) -> MatmulPrecision:
    """The precision the run's matmuls execute in, from Lightning's ``trainer.precision`` string.

    ``"bf16-mixed"``/``"bf16-true"`` -> ``"bf16"``; ``"16-mixed"``/``"16-true"`` -> ``"fp16"``;
    ``"transformer-engine*"`` and ``AccelPrecision``'s ``"fp8-mixed"`` -> ``"fp8"``; ``"64-true"`` -> ``"fp64"``;
    ``"32-true"`` -> ``"tf32"`` when PyTorch lets fp32 matmuls use TF32 (:func:`fp32_uses_tf32`), else ``"fp32"``.
    ``None`` is read as ``"32-true"``.
    """
    p = str(trainer_precision if trainer_precision is not None else "32-true").lower()
    if p.startswith(("transformer-engine", "fp8")):
        return "fp8"
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("64"):
        return "fp64"
    return "tf32" if fp32_uses_tf32("matmul") else "fp32"


@dataclass(frozen=True)
class Estimate:
    """A number that may be unknowable: ``value`` is ``None`` and ``reason`` says why (``""`` when known)."""

    value: float | None
    reason: str = ""


def _check(flops_by_dtype: Mapping[str, float], peaks: Mapping[str, float]) -> None:
    for name, values in (("flops_by_dtype", flops_by_dtype), ("peaks", peaks)):
        for key, v in values.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}[{key!r}]={v!r}: expected a finite number >= 0. Fix: pass FLOPs and FLOP/s.")


def ideal_seconds(flops_by_dtype: Mapping[str, float], peaks: Mapping[str, float]) -> Estimate:
    """Seconds the FLOPs would take at the dense peaks: ``sum(flops_d / peaks[d])`` (module docstring).

    Example::

        >>> ideal_seconds({"bf16": 989.5e12, "fp32": 67e12}, {"bf16": 989.5e12, "fp32": 67e12}).value
        2.0

    Args:
        flops_by_dtype: FLOPs per dtype key, e.g. ``FlopCount.by_dtype``.
        peaks: peak FLOP/s per dtype key, e.g. ``PeakLookup.peaks``.

    Returns:
        An :class:`Estimate`; ``None`` when no FLOPs were counted or a dtype that ran has no (positive) peak.

    Raises:
        ValueError: a negative or non-finite FLOP count or peak.
    """
    _check(flops_by_dtype, peaks)
    ran = {d: f for d, f in flops_by_dtype.items() if f > 0}
    if not ran:
        return Estimate(None, "no FLOPs were counted")
    missing = sorted(d for d in ran if not peaks.get(d))
    if missing:
        share = sum(ran[d] for d in missing) / sum(ran.values())
        known = ", ".join(sorted(d for d, p in peaks.items() if p)) or "none"
        return Estimate(
            None, f"no peak for {', '.join(missing)} ({format_percent(share)} of the FLOPs); peaks known: {known}"
        )
    return Estimate(sum(f / peaks[d] for d, f in ran.items()))


def mfu(flops_by_dtype: Mapping[str, float], peaks: Mapping[str, float], measured_seconds: float) -> Estimate:
    """Model FLOPs utilisation ``ideal_seconds / measured_seconds``, or ``None`` with the reason.

    Above 1 the figure is impossible, so it is ``None`` and ``reason`` gives the numbers and the likely causes:
    the caller warns with it (once) instead of logging it.

    Raises:
        ValueError: a non-positive or non-finite ``measured_seconds``, or what :func:`ideal_seconds` raises.
    """
    if isinstance(measured_seconds, bool) or not math.isfinite(measured_seconds) or measured_seconds <= 0:
        raise ValueError(
            f"mfu(measured_seconds={measured_seconds!r}): expected a finite number > 0. Fix: pass the time."
        )
    ideal = ideal_seconds(flops_by_dtype, peaks)
    if ideal.value is None:
        return ideal
    value = ideal.value / measured_seconds
    if value <= 1.0:
        return Estimate(value)
    used = ", ".join(f"{d} {format_flops_per_second(peaks[d])}" for d in sorted(flops_by_dtype) if flops_by_dtype[d])
    return Estimate(
        None,
        f"MFU would be {format_percent(value)}: the counted FLOPs need {format_seconds(ideal.value)} at the dense"
        f" peaks used ({used}) but ran in {format_seconds(measured_seconds)}. Either a peak is too low for this"
        " device (a wrong table entry or variant: pass the dense peak) or the FLOPs are overcounted (e.g. per-sample"
        " FLOPs times the wrong batch size).",
    )
