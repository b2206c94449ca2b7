"""LossScaleMonitor: CSV acceptance, underflow diagnostics, no host sync on the step path, resume, DDP."""

from __future__ import annotations

import csv
import logging
import math
import warnings
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.overrides import TorchFunctionMode

from lit_accel import AccelPrecision, DynamicGradScaler, LossScaleMonitor
from lit_accel.meters import _scale_sources as scale_sources
from lit_accel.meters import loss_scale as lsm
from tests.helpers import BNModel, make_dataset, make_loader, run_distributed, small_trainer_kwargs

_KEYS = ["amp/loss_scale", "amp/skipped_steps", "amp/skip_rate", "amp/scale_growths", "amp/scale_backoffs"]
_UNDERFLOW_KEYS = ["amp/underflow_frac", "amp/overflow_headroom_log2"]


class _Model(BNModel):
    """BNModel without BN that can overflow on chosen steps, poison one gradient, or have tiny fp32 gradients."""

    def __init__(
        self,
        overflow_at: tuple[int, ...] = (),
        overflow_rank: int | None = None,
        poison_steps: tuple[int, ...] = (),
        loss_factor: float = 1.0,
        fp32_forward: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(batchnorm=False, **kwargs)
        self.overflow_at, self.overflow_rank, self.poison_steps = overflow_at, overflow_rank, poison_steps
        self.loss_factor, self.fp32_forward = loss_factor, fp32_forward

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.fp32_forward:  # gradients computed in fp32: the diagnostic asks what fp16 would do to them
            with torch.autocast("cpu", enabled=False):
                out = self(x.float())
        else:
            out = self(x)
        loss = nn.functional.mse_loss(out.float(), y) * self.loss_factor
        if self.global_step in self.overflow_at and self.overflow_rank in (None, self.global_rank):
            loss = loss * float("inf")
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self) -> None:
        if self.global_step in self.poison_steps:
            self.net[3].bias.grad[0] = float("inf")


def _fp16_plugin(init_scale: float = 2.0**8, growth_interval: int = 10**9) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return MixedPrecision("16-mixed", device="cpu", scaler=scaler)


def _plugin(kind: str, init_scale: float = 2.0**8, growth_interval: int = 10**9, **kwargs: Any) -> Precision:
    """Lightning's MixedPrecision with a real CPU GradScaler, or AccelPrecision with the same settings."""
    if kind == "mixed":
        return _fp16_plugin(init_scale, growth_interval)
    kwargs.setdefault("min_scale", min(1.0, init_scale))
    scaler = DynamicGradScaler(init_scale=init_scale, growth_interval=growth_interval, **kwargs)
    return AccelPrecision("16-mixed", "cpu", scaler=scaler)


def _stats(plugin: Precision) -> tuple[float, int]:
    """(loss scale, skipped steps) from the plugin itself (syncs: fine in a test)."""
    if isinstance(plugin, AccelPrecision):
        return plugin.loss_scale, plugin.skipped_steps
    return plugin.scaler.get_scale(), -1


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **overrides: Any) -> pl.Trainer:
    kwargs = small_trainer_kwargs(
        logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1, callbacks=callbacks
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def _rows(trainer_or_dir: pl.Trainer | Path) -> list[dict[str, str]]:
    log_dir = trainer_or_dir if isinstance(trainer_or_dir, Path) else Path(trainer_or_dir.logger.log_dir)
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _amp_rows(trainer_or_dir: pl.Trainer | Path) -> dict[int, dict[str, float]]:
    """Rows of metrics.csv that carry amp/ keys, by step, with the amp/ values as floats."""
    out = {}
    for row in _rows(trainer_or_dir):
        if row.get("amp/loss_scale"):
            out[int(row["step"])] = {k: float(v) for k, v in row.items() if k.startswith("amp/") and v != ""}
    return out


@pytest.fixture
def info_messages():
    """rank_zero_info records (Lightning's logger does not propagate to the root logger that caplog watches)."""
    records: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = _Handler(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_flush_threshold_is_fp16_round_to_zero():
    """|x| <= 2**-25 is exactly what rounds to zero in fp16 (half of the smallest subnormal, 2**-24)."""
    assert torch.finfo(torch.float16).smallest_normal * 2.0**-10 == 2.0**-24
    edge = torch.tensor(lsm._FP16_FLUSH, dtype=torch.float32)
    above = torch.nextafter(edge, torch.tensor(1.0))
    assert edge.half().item() == 0.0 and (-edge).half().item() == 0.0
    assert above.half().item() == 2.0**-24
    assert torch.tensor(65504.0).half().item() == lsm._FP16_MAX


def test_injected_overflow_is_counted_at_its_step_in_csv(tmp_path, info_messages):
    """Acceptance: with CSVLogger and log_every_n_steps=1, an overflow at step 2 gives skipped_steps == 1 from row 2
    on and the scale halves at row 2, aligned with Lightning's own row of the inf loss."""
    plugin = _fp16_plugin(init_scale=2.0**8)
    # A second monitor with another prefix adds the diagnostics: keys and checkpoint state keys do not collide.
    diag = LossScaleMonitor(log_key_prefix="diag/", track_underflow=True)
    trainer = _trainer(tmp_path, [LossScaleMonitor(), diag], plugins=[plugin], max_steps=5)
    trainer.fit(_Model(overflow_at=(2,)), make_loader(make_dataset(), 8))

    rows = _amp_rows(trainer)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert all(set(r) == set(_KEYS) for r in rows.values())
    diag_rows = {int(r["step"]): r for r in _rows(trainer) if r.get("diag/loss_scale")}
    for step, row in rows.items():
        assert {k: float(diag_rows[step][k.replace("amp/", "diag/")]) for k in _KEYS} == row
    headroom = [float(diag_rows[s]["diag/overflow_headroom_log2"]) for s in range(5)]
    assert headroom[2] == -math.inf and all(0 < h < math.inf for i, h in enumerate(headroom) if i != 2)
    assert [rows[s]["amp/skipped_steps"] for s in range(5)] == [0, 0, 1, 1, 1]
    assert [rows[s]["amp/skip_rate"] for s in range(5)] == [0, 0, 1, 0, 0]
    assert [rows[s]["amp/scale_backoffs"] for s in range(5)] == [0, 0, 1, 1, 1]
    assert [rows[s]["amp/scale_growths"] for s in range(5)] == [0] * 5
    backoff = plugin.scaler.get_backoff_factor()
    assert [rows[s]["amp/loss_scale"] for s in range(5)] == [2.0**8] * 2 + [2.0**8 * backoff] * 3
    assert rows[4]["amp/loss_scale"] == plugin.scaler.get_scale()
    # Lightning logs the inf loss of the same batch at the same step.
    loss_rows = {int(r["step"]): float(r["train_loss"]) for r in _rows(trainer) if r.get("train_loss")}
    assert math.isinf(loss_rows[2]) and all(math.isfinite(v) for s, v in loss_rows.items() if s != 2)
    summary = [m for m in info_messages if m.startswith("LossScaleMonitor: 1 of 5")]
    assert summary == 2 * [
        "LossScaleMonitor: 1 of 5 optimizer steps skipped (20.0%); loss scale final 128, minimum 128."
    ]


def _fit_underflow(
    tmp_path: Path, init_scale: float, optimizer: str = "sgd", max_steps: int = 2, factor=1e-9, kind="mixed"
):
    # Static scales: MixedPrecision never grows (growth_interval 1e9), AccelPrecision(dynamic=False).
    plugin = _fp16_plugin(init_scale=init_scale) if kind == "mixed" else _plugin(kind, init_scale, dynamic=False)
    torch.manual_seed(0)
    model = _Model(loss_factor=factor, fp32_forward=True, optimizer=optimizer)
    trainer = _trainer(tmp_path, [LossScaleMonitor(track_underflow=True)], plugins=[plugin], max_steps=max_steps)
    trainer.fit(model, make_loader(make_dataset(), 8))
    return model, _amp_rows(trainer)[max_steps - 1]


def _expected_underflow(model: nn.Module, scale: float) -> tuple[float, float]:
    grads = [p.grad for p in model.parameters()]
    nonzero = sum(int((g != 0).sum()) for g in grads)
    flushed = sum(int(((g != 0) & (g.abs() * scale <= 2.0**-25)).sum()) for g in grads)
    largest = max(float((g.abs() * scale).max()) for g in grads)
    return flushed / nonzero, math.log2(65504.0 / largest)


@pytest.mark.parametrize("kind", ["mixed", "accel"])
@pytest.mark.parametrize("scale", [1.0, 2.0**16])
def test_underflow_fraction_and_headroom(tmp_path, scale, kind):
    """Tiny (1e-9) gradients: nearly all would flush in fp16 at scale 1, nearly none at 2**16. The logged values equal
    the ones recomputed from the last step's (unscaled, untouched by SGD) gradients."""
    model, row = _fit_underflow(tmp_path, scale, kind=kind)
    assert set(row) == set(_KEYS + _UNDERFLOW_KEYS)
    frac, headroom = _expected_underflow(model, scale)
    assert row["amp/underflow_frac"] == pytest.approx(frac, rel=1e-9)
    assert row["amp/overflow_headroom_log2"] == pytest.approx(headroom, rel=1e-6)
    if scale == 1.0:
        assert row["amp/underflow_frac"] > 0.95
    else:
        assert row["amp/underflow_frac"] < 0.05
        assert row["amp/overflow_headroom_log2"] > 0  # no overflow either


@pytest.mark.parametrize("kind", ["mixed", "accel"])
def test_underflow_is_the_same_for_fused_optimizers_whose_grads_stay_scaled(tmp_path, kind):
    """A fused AdamW is handed the scale instead of unscaled grads; the diagnostic must see through that."""
    _, plain = _fit_underflow(tmp_path / "plain", 2.0**4, "adamw", max_steps=1, factor=1e-7, kind=kind)
    _, fused = _fit_underflow(tmp_path / "fused", 2.0**4, "adamw_fused", max_steps=1, factor=1e-7, kind=kind)
    assert 0.05 < plain["amp/underflow_frac"] < 0.95  # a non-trivial fraction, so equality means something
    assert fused["amp/underflow_frac"] == plain["amp/underflow_frac"]
    assert fused["amp/overflow_headroom_log2"] == plain["amp/overflow_headroom_log2"]


@pytest.mark.parametrize("kind", ["lightning", "accel"])
def test_bf16_logs_nothing_and_says_why_once(tmp_path, info_messages, kind):
    monitor = LossScaleMonitor(track_underflow=True)
    precision = {"precision": "bf16-mixed"} if kind == "lightning" else {"plugins": [AccelPrecision("bf16-mixed")]}
    trainer = _trainer(tmp_path, [monitor], max_steps=3, **precision)
    trainer.fit(_Model(), make_loader(make_dataset(), 8))
    rows = _rows(trainer)
    assert rows and not any(k.startswith("amp/") for k in rows[0])
    why = [m for m in info_messages if m.startswith("LossScaleMonitor")]
    assert len(why) == 1 and "'bf16-mixed'" in why[0] and "no loss scaler" in why[0]
    assert monitor.last_metrics == {}


def test_find_nonfinite_names_the_parameter_and_thresholds_warn_once(tmp_path, info_messages):
    """Every step has an inf in net.3.bias's gradient: each step is named, the skip-rate and the low-scale warnings
    fire exactly once, and the summary counts every step."""
    monitor = LossScaleMonitor(find_nonfinite=True, warmup_steps=0, skip_rate_window=2, min_scale_threshold=1.0)
    trainer = _trainer(tmp_path, [monitor], plugins=[_fp16_plugin(init_scale=4.0)], max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Model(poison_steps=(0, 1, 2, 3)), make_loader(make_dataset(), 8))
    messages = [str(w.message) for w in caught if "LossScaleMonitor" in str(w.message)]
    named = [m for m in messages if "non-finite gradients" in m]
    assert named == [
        f"LossScaleMonitor: optimizer step {s} is skipped: non-finite gradients in 1 of 4 parameters: net.3.bias (inf)."
        for s in range(4)
    ]
    assert len([m for m in messages if "were skipped for inf/NaN" in m]) == 1
    assert len([m for m in messages if "loss scale fell to 0.5" in m]) == 1
    assert len(messages) == 6
    assert "LossScaleMonitor: 4 of 4 optimizer steps skipped (100.0%); loss scale final 0.25, minimum 0.25." in (
        info_messages
    )


class _NoSync(TorchFunctionMode):
    """Fail on every tensor call that forces a device-to-host sync on an accelerator."""

    _SYNCING: ClassVar[set[str]] = {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self._SYNCING:
            raise AssertionError(f"host sync via {func.__name__} on the step path")
        return func(*args, **(kwargs or {}))


class _SyncCheckedMonitor(LossScaleMonitor):
    """Runs the per-step hooks under _NoSync except at logging steps, and counts the reads."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads_in_steps: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with _NoSync():  # underflow accumulation is device ops only, even at logging steps
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start, step, interval = self._last_step, trainer.global_step, self._interval(trainer)
        if step // interval > start // interval:
            real_read = self.meter._read
            self.meter._read = lambda: (self.reads_in_steps.append(step), real_read())[1]
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            del self.meter._read
        else:
            with _NoSync():
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


@pytest.mark.parametrize("kind", ["mixed", "accel"])
def test_no_host_sync_outside_logging_steps_under_accumulation(tmp_path, kind):
    monitor = _SyncCheckedMonitor(track_underflow=True)
    trainer = _trainer(
        tmp_path, [monitor], plugins=[_plugin(kind)], max_steps=7, accumulate_grad_batches=2, log_every_n_steps=3
    )
    with _NoSync(), pytest.raises(AssertionError, match="host sync via item"):
        torch.ones(()).item()  # the checker itself works
    trainer.fit(_Model(overflow_at=(4,)), make_loader(make_dataset(), 4))
    assert monitor.reads_in_steps == [3, 6]
    rows = _amp_rows(trainer)
    assert sorted(rows) == [2, 5]
    assert rows[5]["amp/skipped_steps"] == 1 and rows[5]["amp/skip_rate"] == pytest.approx(1 / 3)
    assert set(rows[5]) == set(_KEYS + _UNDERFLOW_KEYS)


def _resume_fit(tmp_path: Path, max_steps: int, kind: str, ckpt: Path | None = None, init_scale: float = 2.0**8):
    monitor = LossScaleMonitor()
    plugin = _plugin(kind, init_scale=init_scale, growth_interval=2)
    trainer = _trainer(tmp_path, [monitor], plugins=[plugin], max_steps=max_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's mid-epoch resume warning
        trainer.fit(_Model(overflow_at=(2,)), make_loader(make_dataset(), 8), ckpt_path=ckpt)
    return trainer, monitor


@pytest.mark.parametrize("kind", ["mixed", "accel"])
def test_state_dict_round_trip_and_exact_resume(tmp_path, kind):
    """Stop after 3 steps, resume to 6 with a fresh callback and a scaler built with another init scale: the logged
    values equal an uninterrupted 6-step run's (growths, back-offs, skip, minimum scale)."""
    _, straight = _resume_fit(tmp_path / "straight", 6, kind)
    first, monitor = _resume_fit(tmp_path / "first", 3, kind)
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    state = monitor.state_dict()
    # grew after step 1, backed off at 2; AccelPrecision restores its own counters
    assert state["source"] == ({"prev_scale": 2.0**8, "skipped": 1, "growths": 1} if kind == "mixed" else {})
    assert state["min_scale"] == 2.0**8 and state["steps_seen"] == 3
    copy = LossScaleMonitor()
    copy.load_state_dict(state)
    assert copy.state_dict() == state

    _, resumed = _resume_fit(tmp_path / "resumed", 6, kind, ckpt=ckpt, init_scale=2.0**16)
    assert resumed.last_metrics == straight.last_metrics
    assert straight.last_metrics["amp/scale_growths"] == 2 and straight.last_metrics["amp/skipped_steps"] == 1
    assert resumed.state_dict() == straight.state_dict()


def test_state_key_depends_on_the_prefix():
    assert LossScaleMonitor().state_key != LossScaleMonitor(log_key_prefix="amp2/").state_key


def test_state_key_is_built_once_per_prefix():
    # Lightning reads state_key on every hook call: the same string object each time, and the key Lightning's own
    # generator gives (so checkpoints written before the cache still load); a changed prefix gives a new key.
    monitor = LossScaleMonitor()
    assert monitor.state_key is monitor.state_key
    assert monitor.state_key == monitor._generate_state_key(log_key_prefix="amp/")
    monitor.log_key_prefix = "amp2/"
    assert monitor.state_key == LossScaleMonitor(log_key_prefix="amp2/").state_key


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logging_interval": 0}, ValueError, r"LossScaleMonitor\(logging_interval=0\): expected an int >= 1"),
        ({"logging_interval": -5}, ValueError, r"logging_interval=-5\): expected an int >= 1 or None\. Fix: pass e.g."),
        ({"logging_interval": 2.5}, TypeError, r"logging_interval=2.5\): expected an int >= 1 or None"),
        ({"logging_interval": True}, TypeError, r"logging_interval=True\): expected an int"),
        ({"skip_rate_threshold": 0.0}, ValueError, r"skip_rate_threshold=0.0\): expected a fraction in \(0, 1\]"),
        ({"skip_rate_threshold": 1.5}, ValueError, r"skip_rate_threshold=1.5\).*or None to disable"),
        ({"min_scale_threshold": -1.0}, ValueError, r"min_scale_threshold=-1.0\): expected a positive finite"),
        ({"min_scale_threshold": math.inf}, ValueError, r"min_scale_threshold=inf\)"),
        ({"skip_rate_window": 0}, ValueError, r"skip_rate_window=0\): expected an int >= 1"),
        ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1\): expected an int >= 0"),
        ({"log_key_prefix": None}, TypeError, r"log_key_prefix=None\): expected a str"),
        ({"track_underflow": "yes"}, TypeError, r"track_underflow='yes'\): expected True or False"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScaleMonitor(**kwargs)


class _ScaleRecorder(pl.Callback):
    """Test-only: this rank's scaler after every optimizer step (get_scale() syncs: fine in a test)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fit_ddp(rank: int, world_size: int, tmp_path: Path, kind: str) -> dict[str, Any]:
    monitor, recorder = LossScaleMonitor(), _ScaleRecorder()
    trainer = _trainer(
        tmp_path,
        [monitor, recorder],
        devices=world_size,
        strategy=DDPStrategy(),
        plugins=[_plugin(kind, init_scale=2.0**8, growth_interval=2)],
        use_distributed_sampler=False,
        max_steps=4,
    )
    # The overflow happens on rank 1 only; the all-reduce carries it to rank 0, so both scalers skip.
    trainer.fit(_Model(overflow_at=(1,), overflow_rank=1), make_loader(make_dataset(), 4, rank, world_size))
    assert trainer.world_size == world_size and trainer.global_rank == rank
    return {
        "last": monitor.last_metrics,
        "scales": recorder.scales,
        "final": trainer.precision_plugin.scaler.get_scale(),
        "skipped": _stats(trainer.precision_plugin)[1],
    }


@pytest.mark.parametrize("kind", ["mixed", "accel"])
def test_two_process_ddp_rank_zero_logs_values_every_rank_agrees_with(tmp_path, kind):
    results = run_distributed(_fit_ddp, 2, tmp_path, kind, init_process_group=False, timeout=60)
    rows = _amp_rows(tmp_path)  # rank 0's CSVLogger wrote it; rank 1's loggers are no-ops
    assert sorted(rows) == [0, 1, 2, 3]
    for result in results:
        assert [rows[s]["amp/loss_scale"] for s in range(4)] == result["scales"]
        assert result["last"] == {k: rows[3][k] for k in _KEYS}
        assert result["final"] == rows[3]["amp/loss_scale"]
        if kind == "accel":
            assert result["skipped"] == rows[3]["amp/skipped_steps"] == 1
    # growth_interval=2: step 0 is clean, step 1 overflows (back-off, tracker reset), steps 2-3 are clean (growth)
    assert [rows[s]["amp/skipped_steps"] for s in range(4)] == [0, 1, 1, 1]
    assert [rows[s]["amp/loss_scale"] for s in range(4)] == [2.0**8, 2.0**7, 2.0**7, 2.0**8]
    assert rows[3]["amp/scale_growths"] == 1 and rows[3]["amp/scale_backoffs"] == 1


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_accel_precision_logs_the_same_keys_and_values_as_mixed_precision(tmp_path, hysteresis):
    """hysteresis=1 is torch's policy: every logged value equals the MixedPrecision run's. hysteresis=2 tolerates
    one overflow: a skipped step without a back-off, which only the plugin's own counters can tell."""
    torch.manual_seed(0)
    reference = _trainer(tmp_path / "mixed", [LossScaleMonitor()], plugins=[_plugin("mixed", growth_interval=2)])
    reference.fit(_Model(overflow_at=(2,)), make_loader(make_dataset(), 8))
    torch.manual_seed(0)
    plugin = _plugin("accel", growth_interval=2, hysteresis=hysteresis)
    monitor = LossScaleMonitor()
    trainer = _trainer(tmp_path / "accel", [monitor], plugins=[plugin])
    trainer.fit(_Model(overflow_at=(2,)), make_loader(make_dataset(), 8))
    expected, rows = _amp_rows(reference), _amp_rows(trainer)
    assert sorted(rows) == sorted(expected) == [0, 1, 2, 3]
    assert all(set(r) == set(_KEYS) for r in rows.values())
    if hysteresis == 1:
        assert rows == expected
    else:
        assert [rows[s]["amp/skipped_steps"] for s in range(4)] == [0, 0, 1, 1]
        assert [rows[s]["amp/scale_backoffs"] for s in range(4)] == [0] * 4
        # grew after steps 0-1; the overflow at 2 resets the growth tracker without backing off
        assert [rows[s]["amp/loss_scale"] for s in range(4)] == [2.0**8, 2.0**9, 2.0**9, 2.0**9]
    assert (monitor.last_metrics["amp/loss_scale"], monitor.last_metrics["amp/skipped_steps"]) == _stats(plugin)


def test_source_selection():
    from lit_accel.plugins.grad_scaler import DynamicGradScaler

    assert scale_sources.select_source(Precision())[0] is None  # fp32
    disabled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert scale_sources.select_source(disabled)[0] is None
    assert isinstance(scale_sources.select_source(_fp16_plugin())[0], scale_sources.TorchScalerSource)
    assert isinstance(scale_sources.select_source(_plugin("accel"))[0], scale_sources.StatsSource)
    assert (
        scale_sources.select_source(AccelPrecision("bf16-mixed", "cpu"))[0] is None
    )  # its non-finite guard is no scaler
    # lit_accel's scaler inside Lightning's plugin: its own counters (hysteresis) beat the scale comparison
    dynamic = MixedPrecision("16-mixed", "cpu", scaler=DynamicGradScaler("cpu", hysteresis=2))
    assert isinstance(scale_sources.select_source(dynamic)[0], scale_sources.StatsSource)


class _CudaSyncCheckedMonitor(LossScaleMonitor):
    """Runs the per-step hooks with torch.cuda.set_sync_debug_mode("error"), except the read at logging steps."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        torch.cuda.set_sync_debug_mode("error")
        try:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start, step, interval = self._batch_start_step, trainer.global_step, self._interval(trainer)
        logging_step = step // interval > start // interval
        torch.cuda.set_sync_debug_mode(0 if logging_step else "error")
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_16_mixed_logs_and_never_syncs_on_the_step_path(tmp_path):
    """Lightning's CUDA '16-mixed' plugin (MixedPrecision with a CUDA GradScaler; init_scale 2**8 so that only the
    injected overflow overflows), checked by CUDA's own sync detector."""
    monitor = _CudaSyncCheckedMonitor(track_underflow=True)
    plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", init_scale=2.0**8))
    trainer = _trainer(
        tmp_path, [monitor], accelerator="gpu", devices=1, plugins=[plugin], max_steps=6, log_every_n_steps=3
    )
    trainer.fit(_Model(overflow_at=(4,)), make_loader(make_dataset(), 8))
    rows = _amp_rows(trainer)
    assert sorted(rows) == [2, 5]
    assert set(rows[5]) == set(_KEYS + _UNDERFLOW_KEYS)
    assert rows[2]["amp/skipped_steps"] == 0 and rows[5]["amp/skipped_steps"] == 1
    assert rows[5]["amp/loss_scale"] == trainer.precision_plugin.scaler.get_scale()


def test_the_meter_runs_no_op_on_a_clean_step_of_a_dynamic_scaler_and_keeps_the_exact_minimum():
    from tests.helpers.dispatch import OpRecorder

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = DynamicGradScaler(init_scale=2.0**10, growth_interval=3, min_scale=1.0).to("cpu")
    meter = lsm.LossScaleMeter()
    assert meter.attach(scaler)
    overflows, scales, ops_per_step = {4, 5, 9}, [], []
    for step in range(14):
        loss = model(torch.randn(2, 4)).sum() * (float("inf") if step in overflows else 1.0)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        with OpRecorder() as recorder:
            meter.step()
        ops_per_step.append(len(recorder.ops))
        scales.append(scaler.get_scale())  # a host read, for the test only
    changed = [i for i in range(1, 14) if scales[i] != scales[i - 1]]
    assert changed and all(ops_per_step[i] >= 1 for i in changed)  # growths and back-offs: the minimum is updated
    clean = [i for i in range(1, 14) if i not in overflows and scales[i] == scales[i - 1]]
    assert clean and all(ops_per_step[i] == 0 for i in clean), ops_per_step  # the host knew nothing could move
    assert meter.summary()["min_scale"] == min(scales) < 2.0**10
