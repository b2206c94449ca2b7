import pytest
import torch

from lit_accel.utilities._peak_flops import PEAK_TFLOPS, lookup_peak_flops, matmul_precision


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
        ("NVIDIA H100 PCIe", "fp64"),  # the table keeps no fp64 figures
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
