"""EfficiencyMonitor in one process: FLOPs by the dtype they ran in, MFU against each dtype's peak, recompiles."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from lit_accel import EfficiencyMonitor
from lit_accel.meters.tables import peaks_caption
from tests.helpers import CaptureLogger, lightning_info_messages, make_dataset, small_trainer_kwargs

BATCH = 4


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _MixedModel(pl.LightningModule):
    """A bf16 body under autocast and an fp32 head outside it (as LLMs keep their output layer); 1 s per step."""

    def __init__(self, clock: _Clock | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock.now += 1.0
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _flops_of_each_part(model: _MixedModel) -> dict[str, int]:
    """FlopCounterMode's own counts of the body (run under bf16 autocast) and of the head, apart."""
    x = torch.randn(BATCH, 8)
    with FlopCounterMode(display=False) as body:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.body(x)
        h.backward(torch.ones_like(h))
    with FlopCounterMode(display=False) as head:
        model.head(h.detach().float().requires_grad_()).sum().backward()  # its input needs a gradient in the fit
    return {"bf16": body.get_total_flops(), "fp32": head.get_total_flops()}


def test_flops_are_split_by_dtype_as_flop_counter_mode_counts_them_and_mfu_uses_each_dtypes_peak(tmp_path):
    clock, logger = _Clock(), CaptureLogger()
    peaks = {"bf16": 2e6, "fp32": 5e5}
    monitor = EfficiencyMonitor(
        warmup_steps=1, peak_flops=peaks, clock=clock, report_path=tmp_path / "perf.json", print_summary=False
    )
    model = _MixedModel(clock)
    trainer = pl.Trainer(
        **small_trainer_kwargs(
            max_steps=4, precision="bf16-mixed", log_every_n_steps=1, logger=logger, callbacks=[monitor]
        )
    )
    trainer.fit(model, DataLoader(make_dataset(32), batch_size=BATCH))
    parts = _flops_of_each_part(model)
    config = monitor.report["config"]
    assert config["flops_by_dtype"] == {d: f / BATCH for d, f in parts.items()}  # per sample
    assert monitor.flops_per_sample == sum(parts.values()) / BATCH
    # Each step is 1 s of 4 samples: MFU = (bf16 FLOPs / bf16 peak + fp32 FLOPs / fp32 peak) / 1 s.
    expected = parts["bf16"] / peaks["bf16"] + parts["fp32"] / peaks["fp32"]
    for _, metrics in logger.with_prefix("perf/"):
        assert metrics["perf/mfu"] == pytest.approx(expected, rel=1e-12)
        assert metrics["perf/tflops_per_device"] == pytest.approx(sum(parts.values()) / 1e12, rel=1e-12)
    # One peak for both would misstate it: the fp32 head runs at a quarter of the bf16 rate here.
    assert expected != pytest.approx(sum(parts.values()) / peaks["bf16"])
    caption = peaks_caption(config)
    assert caption.startswith("MFU peaks: bf16 2.00 MFLOP/s, fp32 500 kFLOP/s (peak_flops; given as peak_flops)")
    assert (tmp_path / "perf.png").is_file()


def test_a_dtype_without_a_peak_gives_no_mfu_and_says_why_once(tmp_path):
    monitor = EfficiencyMonitor(warmup_steps=1, peak_flops={"bf16": 1e15}, print_summary=False)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=4, precision="bf16-mixed", log_every_n_steps=1,
                                                logger=CaptureLogger(), callbacks=[monitor]))  # fmt: skip
    with lightning_info_messages() as messages:
        trainer.fit(_MixedModel(), DataLoader(make_dataset(32), batch_size=BATCH))
    assert "mfu" not in monitor.summary and monitor.summary["tflops_per_device"] > 0
    said = [m for m in messages if "no MFU" in m]
    assert len(said) == 1 and "no peak for fp32" in said[0] and "peaks known: bf16" in said[0]


class _Layer(nn.Module):
    """Its own forward, so that no other test's compilation of the same code counts here."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0.5


class _Recompiling(pl.LightningModule):
    """A torch.compile'd module (no dynamic shapes) fed a new batch size now and then: each is a recompilation."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled = torch.compile(_Layer(), backend="eager", dynamic=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.compiled(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_recompiles_are_counted_since_fit_start_and_a_storm_after_warm_up_warns_once():
    sizes = [4, 4, 3, 3, 2, 2, 5, 5, 6, 6]  # new shapes at steps 0, 2, 4, 6, 8: 1 compilation, 4 recompilations
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    logger = CaptureLogger()
    monitor = EfficiencyMonitor(warmup_steps=1, count_flops=False, max_recompiles=2, print_summary=False)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=len(sizes), log_every_n_steps=2, logger=logger,
                                                callbacks=[monitor]))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Recompiling(), DataLoader(make_dataset(sum(sizes)), batch_sampler=batches))
    recompiles = [m["perf/recompiles"] for _, m in logger.with_prefix("perf/")]
    assert recompiles == [0, 1, 2, 3, 4]  # logged at steps 1, 3, 5, 7, 9: by then shapes 3, 2, 5, 6 recompiled
    storms = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(storms) == 1 and "recompiled 3 times after the warm-up (more than max_recompiles=2)" in storms[0]
    assert "TORCH_LOGS=recompiles" in storms[0] and monitor.summary["recompiles"] == 4


def test_an_eager_model_logs_no_recompile_key(tmp_path):
    monitor = EfficiencyMonitor(warmup_steps=1, count_flops=False, print_summary=False)
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=3, callbacks=[monitor]))
    trainer.fit(_MixedModel(), DataLoader(make_dataset(32), batch_size=BATCH))
    assert "recompiles" not in monitor.summary
