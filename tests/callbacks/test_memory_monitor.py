"""MemoryMonitor / MemoryMeter: true sizes under AccelDDP and AccelFSDP on 2 gloo processes, activations against an
independent saved-tensor count, bf16 below fp32, checkpointing, no host sync per step, DDPStrategy, a raw loop."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision
from lit_accel.callbacks.memory_monitor import MemoryMonitor
from lit_accel.meters._memory_metrics import DtypeBytes, RankMemory, lever_savings, memory_metrics
from lit_accel.meters.memory import MemoryMeter
from tests.helpers import BNModel, CaptureLogger, make_dataset, make_loader, run_distributed, small_trainer_kwargs

IN, HIDDEN, OUT, BATCH = 64, 255, 64, 8  # 255 rows split 128 / 127: uneven shards, so the ranks differ
WORLD = 2


class _Model(BNModel):
    """Linear(64, 255) -> ReLU -> Linear(255, 64), AdamW; records its own local sizes at every optimizer step."""

    def __init__(self) -> None:
        super().__init__(in_features=IN, hidden=HIDDEN, out_features=OUT, optimizer="adamw", lr=1e-3, batchnorm=False)
        self.by_hand: dict[str, int] = {}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from torch.distributed.tensor import DTensor

        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = list(self.parameters())
        self.by_hand = {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()),
        }


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, 4 * IN), nn.Linear(4 * IN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _Blocks(BNModel):
    """Three repeated blocks: what AccelFSDP(activation_checkpointing=True) checkpoints."""

    def __init__(self) -> None:
        super().__init__(in_features=IN, out_features=OUT, optimizer="adamw", batchnorm=False)
        self.net = nn.Sequential(_Block(), _Block(), _Block())


def _saved_bytes(model: nn.Module, batch: Any, checkpointed: bool = False) -> int:
    """One forward + backward by hand: bytes of the unique storages autograd saves, parameters' storages excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in model.net if checkpointed else [model.net]:
            h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        loss = nn.functional.mse_loss(h.float(), y)
    loss.backward()
    return sum(seen.values())


def _fit(rank: int, model: nn.Module, strategy: Any, monitor: MemoryMonitor, **kwargs: Any) -> None:
    kw = small_trainer_kwargs(devices=WORLD, max_steps=3, log_every_n_steps=2, use_distributed_sampler=False)
    kw.update(strategy=strategy, callbacks=[monitor], **kwargs)
    pl.seed_everything(0, verbose=False)
    pl.Trainer(**kw).fit(model, make_loader(make_dataset(64, IN, OUT), BATCH, rank, WORLD))


class _NoSync(TorchFunctionMode):
    """Fail on every tensor call that forces a device-to-host sync on an accelerator."""

    _SYNCING: ClassVar[set[str]] = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self._SYNCING:
            raise AssertionError(f"host sync via {func.__name__} on the step path")
        return func(*args, **(kwargs or {}))


class _SyncChecked(MemoryMonitor):
    """Every per-step hook under _NoSync, except the logging step's compute (its one gather); counts those steps."""

    def __init__(self) -> None:
        super().__init__(print_summary=False)
        self.computed_at: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with _NoSync():
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss):
        with _NoSync():
            super().on_before_backward(trainer, pl_module, loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with _NoSync():  # sizing the state at logging steps is metadata too
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._logging_step(trainer) and trainer.global_step > self._last_step:
            self.computed_at.append(trainer.global_step)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        else:
            with _NoSync():
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class _ForwardUnderNoSync(_Model):
    """The measured forward runs the saved-tensor hooks: they must not sync either."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with _NoSync():
            return super().training_step(batch, batch_idx)


def _raw_loop(rank: int) -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    module = _Model()
    ddp = DistributedDataParallel(module)
    optimizer = module.configure_optimizers()
    meter = MemoryMeter("cpu")
    for step, (x, y) in enumerate(make_loader(make_dataset(64, IN, OUT), BATCH, rank, WORLD)):
        if step == 3:
            break
        with meter.activations(ddp):
            loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if step == 1:
            meter.record_state(ddp, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert meter.world_size == WORLD
    return meter.compute(step=2)


def _runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    arms = {
        "ddp": (AccelDDP, {}),
        "fsdp": (AccelFSDP, {}),
        "ddp_bf16": (AccelDDP, {"plugins": [AccelPrecision("bf16-mixed")]}),
        "fsdp_bf16": (AccelFSDP, {"plugins": [AccelPrecision("bf16-mixed")]}),
        "lightning_ddp": (DDPStrategy, {}),
    }
    for name, (strategy, kwargs) in arms.items():
        model, monitor = _Model(), MemoryMonitor(print_summary=False)
        _fit(rank, model, strategy(), monitor, **kwargs)
        out[name] = {"summary": monitor.summary, "by_hand": model.by_hand, "row": monitor.meter.rows[rank]}
    for name, kwargs in {"blocks": {}, "blocks_ac": {"activation_checkpointing": True}}.items():
        monitor = MemoryMonitor(print_summary=False)
        _fit(rank, _Blocks(), AccelFSDP(**kwargs), monitor)
        out[name] = monitor.summary
    synced = _SyncChecked()
    _fit(rank, _ForwardUnderNoSync(), AccelDDP(), synced, max_steps=7, log_every_n_steps=3, accumulate_grad_batches=2)
    out["computed_at"] = synced.computed_at
    out["raw"] = _raw_loop(rank)
    assert dist.is_initialized()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_runs, WORLD, init_process_group=False, timeout=240)


def _plain_model_bytes() -> dict[str, int]:
    """From the unsharded model alone: fp32 parameters, as many gradients, AdamW's two moments and steps."""
    params = list(_Model().parameters())
    total = sum(p.numel() * 4 for p in params)
    return {"params": total, "grads": total, "optimizer": 2 * total + 4 * len(params)}


def test_ddp_figures_are_the_true_sizes(runs):
    expected = _plain_model_bytes()
    for rank in runs:
        for arm in ("ddp", "lightning_ddp"):
            summary = rank[arm]["summary"]
            for key, value in expected.items():
                assert summary[f"{key}_mb"] * 1e6 == pytest.approx(value, rel=0.01), (arm, key)
                assert rank[arm]["by_hand"][key] == value
            assert "params_spread" not in summary and summary["sharding_saved_mb"] == 0
        assert rank["lightning_ddp"]["summary"] == rank["ddp"]["summary"]  # Lightning's own strategy: same figures
        assert rank["raw"] == {k: v for k, v in rank["ddp"]["summary"].items() if k in rank["raw"]}  # the meter alone
        assert set(rank["raw"]) == {"params_mb", "grads_mb", "optimizer_mb", "activations_mb", "param_casts_mb"}


def test_fsdp_figures_are_each_ranks_shard(runs):
    expected = _plain_model_bytes()
    rows = [rank["fsdp"]["row"] for rank in runs]
    for key, value in expected.items():
        local = [getattr(row, key).total for row in rows]
        steps = 4 * 4 if key == "optimizer" else 0  # AdamW's 0-d step tensors are not sharded: on every rank
        assert sum(local) - WORLD * steps == value - steps
        for rank, row_bytes in zip(runs, local):
            assert row_bytes == rank["fsdp"]["by_hand"][key]  # the rank's own shards, as the model sees them
            assert row_bytes == pytest.approx(value / WORLD, rel=0.01)  # 1/N within the uneven rounding
            assert getattr(rank["fsdp"]["row"], f"{key}_unsharded") == value
        summary = runs[0]["fsdp"]["summary"]
        assert summary[f"{key}_mb"] * 1e6 == max(local)
        assert summary[f"{key}_spread"] == max(local) / min(local) > 1  # 128 vs 127 rows
    assert summary["sharding_saved_mb"] * 1e6 == max(
        sum(getattr(row, f"{k}_unsharded") - getattr(row, k).total for k in expected) for row in rows
    )


def test_activations_match_an_independent_saved_tensor_count(runs):
    pl.seed_everything(0, verbose=False)
    batch = next(iter(make_loader(make_dataset(64, IN, OUT), BATCH)))
    by_hand = _saved_bytes(_Model(), batch)
    for arm in ("ddp", "fsdp", "lightning_ddp"):
        # FSDP2's unsharded parameters, gathered for the forward, are parameters: not activations.
        assert runs[0][arm]["summary"]["activations_mb"] * 1e6 == pytest.approx(by_hand, rel=0.2), arm
    blocks, checkpointed = _Blocks(), _Blocks()
    assert runs[0]["blocks"]["activations_mb"] * 1e6 == pytest.approx(_saved_bytes(blocks, batch), rel=0.2)
    assert runs[0]["blocks_ac"]["activations_mb"] * 1e6 == pytest.approx(
        _saved_bytes(checkpointed, batch, checkpointed=True), rel=0.2
    )
    assert runs[0]["blocks_ac"]["activations_mb"] < 0.5 * runs[0]["blocks"]["activations_mb"]


def test_bf16_autocast_saves_less_activation_memory_than_fp32(runs):
    for rank in runs:
        for strategy in ("ddp", "fsdp"):
            fp32, bf16 = rank[strategy]["summary"], rank[f"{strategy}_bf16"]["summary"]
            assert bf16["activations_mb"] < 0.8 * fp32["activations_mb"]
            assert rank[f"{strategy}_bf16"]["row"].activations.bf16 > 0 and rank[strategy]["row"].activations.bf16 == 0
            # The estimate "a bf16 activation would be twice as large in fp32" against the fp32 run itself.
            assert bf16["activations_fp32_equivalent_mb"] == pytest.approx(fp32["activations_mb"], rel=0.2)
            assert bf16["autocast_saved_mb"] > 0
        # Autocast under DDP saves a bf16 copy of the second weight for the backward (the first layer's input needs
        # no gradient); FSDP2 gathers bf16 parameters instead, so there is no copy.
        assert rank["ddp_bf16"]["summary"]["param_casts_mb"] * 1e6 == pytest.approx(HIDDEN * OUT * 2)
        assert rank["fsdp_bf16"]["summary"]["param_casts_mb"] == 0


def test_no_host_sync_per_step_outside_logging_steps(runs):
    for rank in runs:
        assert rank["computed_at"] == [3, 6]  # optimizer steps 3 and 6 of 7 (log_every_n_steps=3, accumulation 2)


def test_logs_at_the_cadence_and_writes_the_report_and_the_table(tmp_path, capsys):
    logger = CaptureLogger()
    monitor = MemoryMonitor(report_path=tmp_path / "memory.json")
    trainer = pl.Trainer(**small_trainer_kwargs(max_steps=5, log_every_n_steps=2, callbacks=[monitor], logger=logger))
    trainer.fit(_Model(), make_loader(make_dataset(64, IN, OUT), BATCH))
    assert logger.steps_with("mem/") == [1, 3, 4]  # every 2nd step, then the end of fit's state at the last step
    keys = {"mem/params_mb", "mem/grads_mb", "mem/optimizer_mb", "mem/activations_mb", "mem/param_casts_mb"}
    assert all(set(m) == keys for _, m in logger.with_prefix("mem/"))  # no CUDA keys on CPU; one rank: no spread
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["config"]["strategy"] == "SingleDeviceStrategy" and report["config"]["world_size"] == 1
    params = _plain_model_bytes()["params"]
    assert report["per_rank"][0]["params"] == {"total": params, "by_dtype": {"fp32": params}}
    assert [h["step"] for h in report["history"]] == [1, 3, 4]
    printed = capsys.readouterr().out
    assert "MemoryMonitor: cpu x1" in printed and "optimizer state" in printed and "fp32 132 kB" in printed


def test_metrics_arithmetic_is_exact():
    def row(params: float, activations_bf16: float, peak: float, state: float = 1.0) -> RankMemory:
        return RankMemory(
            params=DtypeBytes(fp32=params),
            activations=DtypeBytes(fp32=1e6, bf16=activations_bf16),
            params_unsharded=4e6,
            state_recorded=state,
            activations_measured=1.0,
            peak_allocated=peak,
            peak_reserved=2 * peak,
            ooms=1.0 if peak > 3e6 else 0.0,
        )

    rows = [row(2e6, 1e6, 3e6), row(1e6, 0.5e6, 4e6)]
    assert RankMemory.from_vector(rows[0].vector()) == rows[0]
    metrics = memory_metrics(rows, cuda=True)
    assert metrics["params_mb"] == 2.0 and metrics["params_spread"] == 2.0
    assert "grads_spread" not in metrics and metrics["grads_mb"] == 0  # equal (zero) on every rank: no spread
    assert metrics["activations_mb"] == 2.0 and metrics["activations_spread"] == 2.0 / 1.5
    assert metrics["peak_allocated_mb"] == 4.0 and metrics["peak_reserved_mb"] == 8.0 and metrics["ooms"] == 1
    levers = lever_savings(rows)
    assert levers["sharding_saved_mb"] == 3.0 and levers["params_unsharded_mb"] == 4.0
    assert levers["autocast_saved_mb"] == 1.0 and levers["activations_fp32_equivalent_mb"] == 3.0
    cpu = memory_metrics([row(1e6, 0, 0, state=0.0)], cuda=False)
    assert cpu == {"activations_mb": 1.0, "param_casts_mb": 0.0}  # state not recorded yet; no CUDA keys


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: MemoryMonitor(report_path=3), TypeError, r"MemoryMonitor\(report_path=3\): expected a path or None"),
        (lambda: MemoryMonitor(print_summary="yes"), TypeError, r"print_summary='yes'\): expected True or False"),
        (lambda: MemoryMonitor(measure_activations=1), TypeError, r"measure_activations=1\): expected True or"),
        (lambda: MemoryMonitor(log_key_prefix=None), TypeError, r"log_key_prefix=None\): expected a str\. Fix"),
        (lambda: MemoryMeter(world_size=0), ValueError, r"MemoryMeter\(world_size=0\): expected an int >= 1"),
        (lambda: MemoryMeter(world_size="2"), TypeError, r"world_size='2'\): expected an int >= 1 or None\. Fix"),
    ],
    ids=["report_path", "print_summary", "measure_activations", "log_key_prefix", "world_size_0", "world_size_str"],
)
def test_bad_arguments_are_rejected(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


class _AlwaysAwake(MemoryMonitor):
    """The reference: overriding the hook keeps Lightning dispatching it at every optimizer step."""

    dispatched = 0

    def on_before_optimizer_step(self, *args: Any) -> None:
        type(self).dispatched += 1
        super().on_before_optimizer_step(*args)


class _ManualEveryOther(_Model):
    """Manual optimization that steps on every other batch (Lightning counts every batch as stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if batch_idx % 2:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
        return loss


@pytest.mark.parametrize(("model", "accumulation"), [(_Model, 1), (_Model, 2), (_ManualEveryOther, 1)])
def test_the_hook_before_the_step_runs_only_around_logging_steps_and_records_the_same(model, accumulation):
    def fit(monitor: MemoryMonitor, dispatches: list[int]) -> list[tuple[int | None, dict[str, float]]]:
        class Count(pl.Callback):  # after the monitor: whether Lightning would dispatch its hook at this batch
            def on_train_batch_start(self, *args: Any) -> None:
                dispatches.append(monitor.__dict__.get("on_before_optimizer_step", "awake") is not None)

        logger = CaptureLogger()
        torch.manual_seed(0)
        kwargs = {"max_steps": 12, "log_every_n_steps": 5, "accumulate_grad_batches": accumulation}
        trainer = pl.Trainer(**small_trainer_kwargs(logger=logger, callbacks=[monitor, Count()], **kwargs))
        trainer.fit(model(), make_loader(make_dataset(96, IN, OUT), BATCH))
        return logger.with_prefix("mem/")

    awake: list[int] = []
    ours: list[int] = []
    reference = fit(_AlwaysAwake(print_summary=False), awake)
    logged = fit(MemoryMonitor(print_summary=False), ours)
    assert logged == reference and len(logged) == 3  # two logging steps and the end of fit: the same figures
    assert all(awake) and sum(ours) <= 2 * 3 * accumulation + 2  # awake only around the 2 logging steps (+ the end)


def test_a_pipeline_stages_received_input_is_an_activation_not_a_parameter():
    """A stage's input is a leaf that requires grad (its gradient goes back to the previous stage), reached through a
    view as FSDP2's unsharded parameters are: it is an activation (it was booked as a parameter, so every pipeline's
    activations were a micro-batch's input short)."""
    from lit_accel.meters._memory_probe import SavedTensorProbe

    layer = nn.Linear(5, 3, bias=False)
    received = torch.randn(4, 5, requires_grad=True)
    probe = SavedTensorProbe(layer.parameters())
    probe.start()
    layer(received.view_as(received)).sum()  # the Linear saves its input (and its weight: a parameter)
    activations, casts = probe.stop()
    assert activations.total == received.numel() * 4 and casts == 0
