import pytest
import torch

from lit_accel.utilities._peak_flops import (
    PEAK_TFLOPS,
    DeviceFacts,
    cuda_device_facts,
    ideal_seconds,
    lookup_peak_flops,
    lookup_peaks,
    matmul_precision,
    mfu,
)


@pytest.mark.parametrize(
    ("device_name", "precision", "tflops"),
    [
        # Driver names as torch.cuda.get_device_name() reports them; figures are the dense datasheet ones.
        ("NVIDIA H200", "bf16", 989.5),  # Lightning's table has no entry for this name
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H100 NVL", "fp8", 1670.5),
        ("NVIDIA H100 PCIe", "fp64", 51.0),  # FP64 tensor cores, which cuBLAS uses for float64 matmuls
        ("NVIDIA A100-SXM4-40GB", "fp64", 19.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GB200", "bf16", 2500.0),
        ("NVIDIA L40S", "bf16", 362.05),  # not L4's figure (Lightning's bug)
        ("NVIDIA L40", "bf16", 181.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA A10", "bf16", 125.0),  # "a10" must not match "a100" or "a10g"
        ("NVIDIA A10G", "bf16", 70.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp16", 112.0),
        ("Tesla V100S-PCIE-32GB", "fp16", 130.0),
        ("Tesla T4", "fp16", 65.0),
        # GeForce: fp16/bf16 with fp32 accumulate run at half the fp16-accumulate rate
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA GeForce RTX 4090", "fp16", 165.2),
        ("NVIDIA GeForce RTX 3090", "fp16", 71.0),
        ("NVIDIA RTX A6000", "bf16", 154.8),
        ("NVIDIA RTX 6000 Ada Generation", "bf16", 364.2),
    ],
)
def test_lookup_returns_the_dense_datasheet_figure(device_name, precision, tflops):
    assert lookup_peak_flops(device_name, precision) == tflops * 1e12


@pytest.mark.parametrize(
    ("device_name", "precision"),
    [
        ("cpu", "fp32"),
        ("NVIDIA H800", "bf16"),  # unknown part
        ("NVIDIA GeForce RTX 4090 D", "bf16"),  # a cut-down variant must not borrow the 4090's figure
        ("NVIDIA GeForce RTX 3090 Ti", "bf16"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", "bf16"),
        ("Tesla V100-SXM2-16GB", "bf16"),  # Volta has no bf16 tensor cores
        ("Tesla T4", "tf32"),
        ("NVIDIA L40S", "fp64"),  # fp64 figures only where the datasheet gives FP64 tensor cores
        ("NVIDIA H100 PCIe", "fp4"),
    ],
)
def test_unknown_device_or_precision_gives_none(device_name, precision):
    assert lookup_peak_flops(device_name, precision) is None


def test_every_entry_has_plausible_dense_figures():
    for name, figures in PEAK_TFLOPS.items():
        assert name == name.lower() and "fp32" in figures, name
        # tensor-core formats are never slower than plain fp32, and bf16 runs at 2x tf32 (datasheets round)
        for precision in ("tf32", "bf16", "fp16", "fp8"):
            if precision in figures:
                assert figures[precision] >= figures["fp32"], (name, precision)
        if "tf32" in figures and "bf16" in figures:
            assert figures["bf16"] == pytest.approx(2 * figures["tf32"], rel=0.015), name  # L40S: 1.1% off
        if "fp8" in figures:
            # 2x bf16 on every part; the L40S datasheet's dense bf16 (362.05) is 1.2% below half its fp8 (733)
            assert figures["fp8"] == pytest.approx(2 * figures["bf16"], rel=0.015), name


@pytest.mark.parametrize(
    ("trainer_precision", "expected"),
    [
        ("bf16-mixed", "bf16"),
        ("bf16-true", "bf16"),
        ("16-mixed", "fp16"),
        ("16-true", "fp16"),
        ("transformer-engine", "fp8"),
        ("fp8-mixed", "fp8"),  # AccelPrecision's FP8 training
        ("64-true", "fp64"),
    ],
)
def test_matmul_precision_of_lightning_precision_strings(trainer_precision, expected):
    assert matmul_precision(trainer_precision) == expected


def test_32_true_is_tf32_only_when_pytorch_allows_it():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("32-true") == "fp32"
        assert matmul_precision(None) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_mig_slice_has_no_table_peak():
    # A slice has a fraction of the GPU's compute: the full GPU's peak would understate MFU several-fold.
    assert lookup_peak_flops("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16") is None
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16") is None
    assert lookup_peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == 312e12


MIB, GB = 2**20, 10**9


@pytest.mark.parametrize(
    ("device_name", "facts", "entry"),
    [
        # Driver names with the memory torch reports (total_memory) and the default power limit, as seen on such
        # machines (nvidia-smi: H200 143771 MiB, H100 SXM 81559 MiB 700 W, H100 NVL 95830 MiB 400 W).
        ("NVIDIA H200", {}, "h200 sxm"),
        ("NVIDIA H200", {"memory_bytes": 143771 * MIB, "power_limit_w": 700, "sm_count": 132}, "h200 sxm"),
        ("NVIDIA H200", {"power_limit_w": 600}, "h200 nvl"),  # an NVL that reports the plain name
        ("NVIDIA H200 NVL", {}, "h200 nvl"),
        ("NVIDIA H200 NVL", {"memory_bytes": 143771 * MIB, "power_limit_w": 600}, "h200 nvl"),
        ("NVIDIA H200 PCIe", {}, "h200 nvl"),  # NVIDIA's vGPU tables name the NVL card so
        # Other spellings of the same parts (cloud images, containers, nvidia-smi -L): the name decides, then power.
        ("NVIDIA H200 141GB HBM3e", {}, "h200 sxm"),
        ("NVIDIA H200 SXM5 141GB", {"power_limit_w": 700}, "h200 sxm"),
        ("NVIDIA-H200", {}, "h200 sxm"),
        ("nvidia h200 nvl", {}, "h200 nvl"),
        ("NVIDIA H200 NVL 141GB", {"power_limit_w": 600}, "h200 nvl"),
        ("NVIDIA H100 80GB HBM3", {}, "h100 sxm"),
        ("NVIDIA H100 80GB HBM3", {"memory_bytes": 81559 * MIB, "power_limit_w": 700}, "h100 sxm"),
        ("NVIDIA H100 SXM5 80GB", {}, "h100 sxm"),
        ("NVIDIA H100 PCIe", {}, "h100 pcie"),
        ("NVIDIA H100 NVL", {"memory_bytes": 99961274368, "power_limit_w": 400}, "h100 nvl"),
        # A plain "NVIDIA H100": the SM count, the power limit, then the memory decide.
        ("NVIDIA H100", {"sm_count": 114}, "h100 pcie"),
        ("NVIDIA H100", {"power_limit_w": 700, "memory_bytes": 96 * GB}, "h100 sxm"),  # 96 GB SXM parts exist
        ("NVIDIA H100", {"power_limit_w": 400, "memory_bytes": 99961274368}, "h100 nvl"),
        ("NVIDIA H100", {"power_limit_w": 350, "memory_bytes": 81559 * MIB}, "h100 pcie"),
        ("NVIDIA H100", {"power_limit_w": 400}, "h100 nvl"),  # PCIe or NVL: the higher peak
        ("NVIDIA H100", {}, "h100 sxm"),  # unknown form factor: the highest peak, so MFU is not overstated
        ("NVIDIA GH200 480GB", {}, "gh200"),
        ("NVIDIA B200", {}, "b200"),
        ("NVIDIA GB200", {}, "gb200"),
        ("NVIDIA A100-SXM4-40GB", {}, "a100"),
        ("NVIDIA A100-SXM4-80GB", {}, "a100"),
        ("NVIDIA A100-PCIE-40GB", {}, "a100"),
        ("NVIDIA A100 80GB PCIe", {}, "a100"),
        ("NVIDIA L40S", {}, "l40s"),
        ("NVIDIA L40", {}, "l40"),
        ("NVIDIA L4", {}, "l4"),
        ("NVIDIA A10", {}, "a10"),
        ("NVIDIA A10G", {}, "a10g"),
        ("NVIDIA GeForce RTX 3090", {}, "rtx 3090"),
        ("NVIDIA GeForce RTX 4090", {}, "rtx 4090"),
    ],
)
def test_driver_names_and_facts_map_to_the_right_entry(device_name, facts, entry):
    lookup = lookup_peaks(device_name, **facts)
    assert lookup.entry == entry, lookup.reason
    assert lookup.peaks == {p: t * 1e12 for p, t in PEAK_TFLOPS[entry].items()}
    assert device_name in lookup.reason
    assert DeviceFacts(device_name, **facts).lookup() == lookup


@pytest.mark.parametrize(
    ("device_name", "facts", "words"),
    [
        ("NVIDIA H200", {"power_limit_w": 600, "memory_bytes": 143771 * MIB}, ["600 W", "140 GiB", "NVL"]),
        ("NVIDIA H200", {}, ["SXM", "141 GB"]),
        ("NVIDIA H100 80GB HBM3", {}, ["'h100'", "80GB HBM3"]),
        ("NVIDIA H100", {"sm_count": 114}, ["114 SMs"]),
        ("NVIDIA H100", {}, ["assumed", "power_limit_w"]),
    ],
)
def test_the_reason_names_the_matched_tokens_and_the_deciding_fact(device_name, facts, words):
    reason = lookup_peaks(device_name, **facts).reason
    assert all(w in reason for w in words), reason


@pytest.mark.parametrize(
    ("device_name", "words"),
    [
        ("cpu", ["no entry"]),
        ("NVIDIA H20", ["no entry"]),  # a different, slower part: must not match "h200"
        ("NVIDIA H800", ["no entry"]),
        ("NVIDIA GeForce RTX 5090", ["no entry"]),  # no datasheet figure with fp32 accumulate could be sourced
        ("NVIDIA GeForce RTX 4090 D", ["'rtx 4090' followed by 'd'"]),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", ["MIG slice", "own peak"]),
        ("NVIDIA H200 MIG 3g.71gb", ["MIG slice"]),
    ],
)
def test_unknown_devices_and_mig_slices_get_no_entry_and_an_explanation(device_name, words):
    lookup = lookup_peaks(device_name, memory_bytes=80 * GB, power_limit_w=700)
    assert lookup.entry is None and lookup.peaks == {}
    assert all(w in lookup.reason for w in words), lookup.reason


def test_cuda_device_facts_needs_cuda_and_identifies_this_gpu():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"cuda_device_facts\(0\): CUDA is not available"):
            cuda_device_facts(0)
        return
    facts = cuda_device_facts(0)
    props = torch.cuda.get_device_properties(0)
    assert (facts.name, facts.memory_bytes, facts.sm_count) == (
        props.name,
        props.total_memory,
        props.multi_processor_count,
    )
    assert facts.power_limit_w is None or 50 <= facts.power_limit_w <= 2000  # W, not mW; None without NVML
    assert facts.name in facts.lookup().reason


# -------------------------------------------------------------------------------- precision-aware MFU arithmetic
def test_ideal_seconds_sums_each_dtypes_flops_over_its_own_peak():
    # 3e12 bf16 FLOPs at 1e12 FLOP/s take 3 s; 1e12 fp32 FLOPs at 0.5e12 FLOP/s take 2 s
    peaks = {"bf16": 1e12, "fp32": 0.5e12, "fp8": 2e12}
    assert ideal_seconds({"bf16": 3e12, "fp32": 1e12}, peaks).value == 5.0
    assert ideal_seconds({"bf16": 3e12, "fp32": 1e12, "fp8": 0}, peaks).value == 5.0  # dtypes with 0 FLOPs
    # one dtype: PaLM's flops / (peak x seconds)
    assert mfu({"bf16": 6e12}, peaks, measured_seconds=10.0).value == pytest.approx(6e12 / (1e12 * 10.0))
    assert mfu({"bf16": 3e12, "fp32": 1e12}, peaks, measured_seconds=8.0).value == 5.0 / 8.0


@pytest.mark.parametrize(
    ("flops", "peaks", "words"),
    [
        ({"bf16": 3e12, "fp8": 1e12}, {"bf16": 1e12}, ["no peak for fp8", "25.0% of the FLOPs", "known: bf16"]),
        ({"fp8": 1e12}, {"bf16": 1e12, "fp8": 0.0}, ["no peak for fp8", "100%"]),  # a zero peak is no peak
        ({}, {"bf16": 1e12}, ["no FLOPs"]),
        ({"bf16": 0}, {"bf16": 1e12}, ["no FLOPs"]),
    ],
)
def test_ideal_seconds_is_none_with_a_reason_when_it_cannot_be_known(flops, peaks, words):
    for estimate in (ideal_seconds(flops, peaks), mfu(flops, peaks, measured_seconds=1.0)):
        assert estimate.value is None and all(w in estimate.reason for w in words), estimate.reason


def test_mfu_above_one_is_refused_with_the_numbers_and_the_likely_causes():
    estimate = mfu({"bf16": 2e12, "fp32": 1e11}, {"bf16": 1e12, "fp32": 1e11}, measured_seconds=2.0)
    assert estimate.value is None  # ideal 3 s in a measured 2 s: 150%
    for words in ("150%", "3.00 s", "2.00 s", "bf16 1.00 TFLOP/s", "fp32 100 GFLOP/s", "peak is too low"):
        assert words in estimate.reason, (words, estimate.reason)
    assert mfu({"bf16": 2e12}, {"bf16": 1e12}, measured_seconds=2.0).value == 1.0  # exactly 1 is possible


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ideal_seconds({"bf16": -1.0}, {"bf16": 1e12}), r"flops_by_dtype\['bf16'\]=-1.0: expected a finite"),
        (lambda: ideal_seconds({"bf16": 1.0}, {"bf16": float("inf")}), r"peaks\['bf16'\]=inf"),
        (lambda: mfu({"bf16": 1.0}, {"bf16": 1e12}, measured_seconds=0.0), r"mfu\(measured_seconds=0.0\)"),
        (lambda: mfu({"bf16": 1.0}, {"bf16": 1e12}, measured_seconds=float("nan")), r"measured_seconds=nan"),
    ],
)
def test_bad_mfu_inputs_raise_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
