"""The end-of-fit tables choose units by magnitude: a CPU run reads GFLOP/s and kB, never "0.00 TFLOP/s"."""

from __future__ import annotations

import re

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from lit_accel import MemoryMeter
from lit_accel.meters.tables import comm_note, efficiency_table, memory_table, peaks_caption


def _text(table: Table) -> str:
    console = Console(record=True, width=140)
    console.print(table)
    return console.export_text()


def test_the_efficiency_table_picks_each_unit_by_magnitude():
    summary = {
        "tflops_per_device": 0.00321,  # 3.21 GFLOP/s
        "peak_memory_gb": 0.000512,
        "comm_gb_per_step": 2.5e-6,
        "comm_busbw_gbps": 0.0123,
        "step_time_ms": 0.042,
        "mfu": 0.4567,
        "comm_exposed_frac": 0.00123,
        "straggler_rank": -1.0,
        "measured_steps": 1234.0,
    }
    text = _text(efficiency_table(summary, "run"))
    for piece in ("3.21 GFLOP/s", "512 kB", "2.50 kB", "12.3 MB/s", "42.0 µs", "45.7%", "0.123%", "1,234"):
        assert piece in text, piece
    assert "0.00" not in text and "TFLOP/s" not in text and "GB" not in text
    # words, not sentinels: no straggler reads "none", a named one "rank 1"
    assert re.search(r"straggler\s+│\s+none", text) and "-1" not in text
    assert re.search(r"straggler\s+│\s+rank 1", _text(efficiency_table({"straggler_rank": 1.0}, "run")))


def test_the_table_says_why_comm_figures_are_absent():
    note = comm_note("DDPStrategy", world_size=2, has_comm_stats=False)
    assert note == "not measured: DDPStrategy counts no collectives (no comm_stats); AccelDDP and AccelFSDP do"
    text = _text(efficiency_table({"samples_per_sec": 10.0}, "run", comm_note=note))
    assert "gradient comm" in text and "DDPStrategy counts no collectives" in text
    # the note only stands in for missing rows: with comm figures, or on one rank, there is none
    assert "counts no" not in _text(efficiency_table({"comm_gb_per_step": 1.0}, "run", comm_note=note))
    assert comm_note("DDPStrategy", world_size=1, has_comm_stats=False) is None
    assert comm_note("AccelDDP", world_size=2, has_comm_stats=True) is None


def test_the_caption_names_the_peak_table_entry_and_why():
    config = {
        "peak_flops": {"bf16": 989.5e12, "fp32": 67e12, "fp8": 1979e12},
        "flops_by_dtype": {"bf16": 9.0, "fp32": 1.0},
        "peak_entry": "h200 sxm",
        "peak_reason": "name 'NVIDIA H200' (tokens 'h200')",
    }
    assert peaks_caption(config) == (
        "MFU peaks: bf16 990 TFLOP/s, fp32 67.0 TFLOP/s (table entry 'h200 sxm'; name 'NVIDIA H200' (tokens 'h200'))"
    )
    unknown = peaks_caption({"peak_flops": None, "peak_reason": "'cpu' matches no entry of the peak table"})
    assert unknown == "no MFU: 'cpu' matches no entry of the peak table. Fix: pass peak_flops=."


def test_the_memory_table_picks_each_unit_by_magnitude():
    model = nn.Linear(10, 10)  # 110 fp32 parameters: 440 B
    optimizer = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter("cpu", world_size=1)
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    meter.record_state(model, optimizer)
    meter.compute(0)
    text = _text(memory_table(meter.rows, meter.summary(), "memory"))
    assert "440 B" in text and "888 B" in text  # exp_avg + exp_avg_sq (880 B) and the 0-d step (8 B)
    assert "0.0" not in text and "MB" not in text
