"""Both monitors with manual optimization (several optimizers per batch) and with logging switched off.

A batch in which several optimizers step is one training step for the monitors, as it is for Lightning's own logging
(``self.log``) and for ``AccelPrecision``'s scale update: rows must land on the steps Lightning logs the loss at.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_accel import AccelPrecision, DynamicGradScaler, EfficiencyMonitor, LossScaleMonitor
from tests.helpers import CaptureLogger, small_trainer_kwargs

INF = float("inf")
# Two passes per batch, as a GAN's discriminator and generator updates: a = Linear(8, 16) and b = Linear(8, 4), each
# on the input, whose gradient is not needed. Per sample (2 FLOPs per MAC): forward + weight gradient of each.
TWO_PASS_FLOPS_PER_SAMPLE = 2 * 2 * (8 * 16) + 2 * 2 * (8 * 4)


class TwoPassGAN(pl.LightningModule):
    """Two forward/backward passes and two optimizer steps per batch; ``overflow`` iterations make both inf."""

    def __init__(self, overflow=()):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(8, 4, bias=False)
        self.overflow = set(overflow)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        factor = INF if batch_idx in self.overflow else 1.0
        loss_a = self.a(x).float().pow(2).mean() * factor
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        loss_b = self.b(x).float().pow(2).mean() * factor
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.log("loss_b", loss_b)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)


def _fit(model, callbacks, batches=8, batch_size=4, **kwargs):
    logger = CaptureLogger()
    kwargs = small_trainer_kwargs(max_epochs=1, max_steps=-1, logger=logger, callbacks=callbacks, **kwargs)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(batches * batch_size, 8)), batch_size=batch_size))
    return trainer, logger


def test_efficiency_monitor_counts_a_batch_with_two_optimizer_steps_as_one_step_and_all_its_flops():
    monitor = EfficiencyMonitor(warmup_steps=2, print_summary=False)
    trainer, logger = _fit(TwoPassGAN(), [monitor], log_every_n_steps=2)
    assert trainer.global_step == 16  # Lightning counts each optimizer's step
    assert monitor.flops_per_sample == TWO_PASS_FLOPS_PER_SAMPLE  # both passes, not only the first
    assert monitor.summary["measured_steps"] == 8 - 2  # batches after warm-up
    # Rows on the steps Lightning logs self.log values at (every 2nd batch), from the end of the warm-up on.
    assert logger.steps_with("perf/") == [s for s in logger.steps_with("loss_b") if s >= 2]
    assert logger.steps_with("perf/") == [3, 5, 7]


def test_loss_scale_monitor_logs_one_row_per_logging_step_of_batches_with_two_optimizers():
    monitor = LossScaleMonitor()
    plugin = AccelPrecision("16-mixed", "cpu", scaler=DynamicGradScaler(init_scale=2.0**8, growth_interval=1000))
    _, logger = _fit(TwoPassGAN(overflow={2}), [monitor], plugins=[plugin], log_every_n_steps=4)
    assert logger.steps_with("amp/") == logger.steps_with("loss_b") == [3, 7]
    rows = [m for _, m in logger.rows if "amp/skipped_steps" in m]
    # Batch 2 overflowed in both passes: two skipped optimizer steps (each backed off) of the 8 in the first window.
    assert [r["amp/skipped_steps"] for r in rows] == [2, 2]
    assert [r["amp/skip_rate"] for r in rows] == [0.25, 0.0]
    assert [r["amp/scale_backoffs"] for r in rows] == [2, 2]
    assert [r["amp/loss_scale"] for r in rows] == [2.0**6, 2.0**6]


def test_log_every_n_steps_zero_logs_nothing_and_still_summarises():
    # Trainer(barebones=True), the benchmarking mode, forces log_every_n_steps=0.
    efficiency = EfficiencyMonitor(warmup_steps=1, print_summary=False)
    scale = LossScaleMonitor()

    class _Model(TwoPassGAN):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)

    trainer, logger = _fit(
        _Model(), [efficiency, scale], plugins=[AccelPrecision("16-mixed", "cpu")], log_every_n_steps=0
    )
    assert trainer.global_step == 16
    assert logger.steps_with("perf/") == [] and logger.steps_with("amp/") == []
    assert efficiency.summary["measured_steps"] == 7
