"""Gradient accumulation with AccelDDP (issue #4): the global-batch rule, partial windows, one all-reduce per step.

Every equivalence is against a single-process Trainer with one big batch per step, run in the pytest process (which
never creates a process group: AccelDDP runs, even on one process, live in forked ranks).
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from lit_accel import AccelDDP
from tests.helpers import (
    BNModel,
    lightning_info_messages,
    make_dataset,
    make_loader,
    params_of,
    run_distributed,
    small_trainer_kwargs,
)

# 80 samples in micro-batches of 8 with a global batch of 32: windows of 4, 4, 2 micro-batches on one process and
# 2, 2, 1 on two, i.e. big batches of 32, 32 and 16 samples. Two epochs check that windows restart with the epoch.
N_SAMPLES, MICRO, GLOBAL, EPOCHS = 80, 8, 32, 2
ATOL = 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Training equivalence (real processes)
# ----------------------------------------------------------------------------------------------------------------


def _counted_allreduce(state, bucket):
    """torch's all-reduce mean as a user comm hook: AccelDDP's wrapper then counts every collective really issued.

    Without a hook (the default) ``comm_stats`` is derived from the rounds AccelDDP counts and DDP's bucket layout;
    the tests whose point is how many all-reduces really happen use this hook instead.
    """
    return default_hooks.allreduce_hook(state, bucket)


class _Recorder(pl.Callback):
    """Gradients seen by every optimizer step, and the strategy's all-reduce counters after every micro-batch."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.calls: list[int] = []
        self.bytes: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        self.calls.append(stats.calls if stats is not None else 0)
        self.bytes.append(stats.bytes if stats is not None else 0)


def _fit(rank, world_size, strategy, batch_size, *, n=N_SAMPLES, epochs=EPOCHS, max_steps=-1, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=False)
    recorder = _Recorder()
    kwargs = small_trainer_kwargs(max_steps=max_steps, max_epochs=epochs, callbacks=[recorder], **trainer_kwargs)
    if strategy is not None:
        kwargs.update(devices=world_size, strategy=strategy, use_distributed_sampler=False)
        loader = make_loader(make_dataset(n), batch_size, rank, world_size)
    else:
        loader = make_loader(make_dataset(n), batch_size)
    trainer = pl.Trainer(**kwargs)
    with lightning_info_messages() as messages:
        trainer.fit(model, loader)
    return {
        "state": params_of(model),
        "grads": recorder.grads,
        "calls": recorder.calls,
        "bytes": recorder.bytes,
        "accumulation": trainer.accumulate_grad_batches,
        "global": getattr(trainer.strategy, "global_batch_size", None),
        "micro": getattr(trainer.strategy, "micro_batch_size", None),
        "messages": messages,
    }


def _strategy(global_batch_size: int | None = None, counted: bool = False, **kwargs) -> AccelDDP:
    hook = _counted_allreduce if counted else None
    return AccelDDP(global_batch_size=global_batch_size, sync_batchnorm=False, comm_hook=hook, **kwargs)


def _accumulating_runs(rank: int, world_size: int) -> dict[str, dict]:
    # "mean" runs the default (no comm hook), as users do; "*_counted", "k1", "k4" and "trainer_flag" count the
    # all-reduces really issued, through a comm hook.
    runs = {
        "mean": _fit(rank, world_size, _strategy(GLOBAL), MICRO),
        "mean_counted": _fit(rank, world_size, _strategy(GLOBAL, counted=True), MICRO),
    }
    if world_size == 1:
        runs["lightning"] = _fit(rank, world_size, _strategy(GLOBAL, partial_window="lightning"), MICRO)
    else:
        # The same accumulation from the Trainer flag (no global_batch_size), and k = 1 and 4 for the counts.
        runs["trainer_flag"] = _fit(rank, world_size, _strategy(counted=True), MICRO, accumulate_grad_batches=2)
        runs["k1"] = _fit(rank, world_size, _strategy(16, counted=True), MICRO)
        runs["k1_default"] = _fit(rank, world_size, _strategy(16), MICRO)
        runs["k4"] = _fit(rank, world_size, _strategy(64, counted=True), MICRO)
    return runs


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, one big batch of GLOBAL samples per step (the last one of each epoch has 16), no accumulation."""
    return _fit(0, 1, None, GLOBAL)


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    return run_distributed(_accumulating_runs, 1, init_process_group=False, timeout=120)[0]


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, dict]]:
    return run_distributed(_accumulating_runs, 2, init_process_group=False, timeout=120)


def _assert_states_close(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


def _window_ends(batches_per_epoch: int, k: int, epochs: int) -> list[bool]:
    """True for the micro-batches on which Lightning steps: every k-th and the last of each epoch."""
    return [(i + 1) % k == 0 or i == batches_per_epoch - 1 for _ in range(epochs) for i in range(batches_per_epoch)]


def test_same_global_batch_on_one_and_two_processes_equals_the_big_batch(reference, one_process, two_processes):
    # 1 process: accumulation 4 (k micro-batches == one batch k times larger); 2 processes: accumulation 2.
    assert one_process["mean"]["accumulation"] == 4
    assert [run["mean"]["accumulation"] for run in two_processes] == [2, 2]
    for run in (one_process["mean"], *(r["mean"] for r in two_processes)):
        assert (run["global"], run["micro"]) == (GLOBAL, MICRO)
        assert len(run["grads"]) == len(reference["grads"]) == 3 * EPOCHS
        for grads, expected in zip(run["grads"], reference["grads"]):
            _assert_states_close(grads, expected)
        _assert_states_close(run["state"], reference["state"])
    rank0, rank1 = (r["mean"]["state"] for r in two_processes)
    _assert_states_close(rank0, rank1, atol=0)
    # Without global_batch_size, Trainer(accumulate_grad_batches=2) keeps working, with the same result.
    _assert_states_close(two_processes[0]["trainer_flag"]["state"], reference["state"])
    assert two_processes[0]["trainer_flag"]["accumulation"] == 2


def test_the_decomposition_is_logged_once(one_process, two_processes):
    for run, line in (
        (one_process["mean"], "global batch 32 = 8 loaded x 4 accumulation x 1 data-parallel rank"),
        (two_processes[0]["mean"], "global batch 32 = 8 loaded x 2 accumulation x 2 data-parallel ranks"),
    ):
        assert [m for m in run["messages"] if "global batch" in m] == [f"AccelDDP: {line}"]
    assert not [m for m in two_processes[1]["mean"]["messages"] if "global batch" in m]  # rank zero only


def test_partial_window_is_averaged_over_its_micro_batches_and_lightning_mode_is_kept(reference, one_process):
    # The third step of each epoch is a window of 2 micro-batches out of k = 4.
    mean, lightning = one_process["mean"], one_process["lightning"]
    _assert_states_close(mean["grads"][2], reference["grads"][2])
    # partial_window="lightning" divides by the configured k: the same first two steps, then half the gradient.
    for step in (0, 1):
        _assert_states_close(lightning["grads"][step], reference["grads"][step])
    half = {k: v * (2 / 4) for k, v in reference["grads"][2].items()}
    _assert_states_close(lightning["grads"][2], half)
    difference = max((lightning["state"][k] - reference["state"][k]).abs().max().item() for k in reference["state"])
    assert difference > 100 * ATOL


def test_one_all_reduce_round_per_optimizer_step_whatever_k(one_process, two_processes):
    # Real collectives, counted by a comm hook.
    batches_per_epoch = {1: N_SAMPLES // MICRO, 2: N_SAMPLES // MICRO // 2}
    per_step_counts = set()
    cases = [(one_process["mean_counted"], 1, 4)]
    for ranks in two_processes:
        cases += [
            (ranks["k1"], 2, 1),
            (ranks["mean_counted"], 2, 2),
            (ranks["k4"], 2, 4),
            (ranks["trainer_flag"], 2, 2),
        ]
    for run, world_size, k in cases:
        assert run["accumulation"] == k
        increments = [b - a for a, b in zip([0, *run["calls"]], run["calls"])]
        ends = _window_ends(batches_per_epoch[world_size], k, EPOCHS)
        # No all-reduce on non-final micro-batches of a window ...
        assert [inc for inc, end in zip(increments, ends) if not end] == [0] * ends.count(False)
        # ... and the same number (one round over DDP's buckets) on every optimizer step.
        per_step_counts |= {inc for inc, end in zip(increments, ends) if end}
    assert len(per_step_counts) == 1 and per_step_counts.pop() >= 1


def test_default_counters_equal_the_counted_all_reduces_with_and_without_accumulation(one_process, two_processes):
    numel = sum(p.numel() for p in BNModel(batchnorm=False).parameters())
    batches_per_epoch = {1: N_SAMPLES // MICRO, 2: N_SAMPLES // MICRO // 2}
    cases = [(one_process["mean"], one_process["mean_counted"], 1, 4)]
    for ranks in two_processes:
        cases += [(ranks["mean"], ranks["mean_counted"], 2, 2), (ranks["k1_default"], ranks["k1"], 2, 1)]
    for default, counted, world_size, k in cases:
        assert default["accumulation"] == counted["accumulation"] == k
        # Micro-batch by micro-batch, the same collectives as the hook really saw (one bucket: no layout change) ...
        assert default["calls"] == counted["calls"], (world_size, k)
        # ... and the fp32 gradient bytes once per optimizer step (per rank), nothing on non-final micro-batches.
        ends = _window_ends(batches_per_epoch[world_size], k, EPOCHS)
        increments = [b - a for a, b in zip([0, *default["bytes"]], default["bytes"])]
        assert increments == [4 * numel if end else 0 for end in ends], (world_size, k)
        assert default["bytes"] == counted["bytes"]


# ----------------------------------------------------------------------------------------------------------------
# Refusals before the first step
# ----------------------------------------------------------------------------------------------------------------


def _error_of(rank, world_size, strategy, batch_size=MICRO, loader=None, **trainer_kwargs) -> tuple[str, bool, int]:
    """Fit and return (error message, whether the weights are untouched, all-reduces issued)."""
    pl.seed_everything(0, verbose=False)
    model = BNModel(batchnorm=False)
    before = params_of(model)
    kwargs = small_trainer_kwargs(devices=world_size, strategy=strategy, use_distributed_sampler=False, max_steps=2)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    if loader is None:
        loader = make_loader(make_dataset(64), batch_size, rank, world_size)
    try:
        trainer.fit(model, loader)
    except ValueError as err:
        after = params_of(model)
        untouched = all(torch.equal(before[k], after[k]) for k in before)
        return str(err), untouched, strategy.comm_stats.calls
    return "", False, strategy.comm_stats.calls


class _NoSizeBatchSampler:
    """A batch sampler without a ``batch_size`` attribute: the micro-batch cannot be read."""

    def __init__(self, n: int, size: int) -> None:
        self.batches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _refusals(rank: int, world_size: int) -> dict[str, tuple[str, bool, int]]:
    # Every strategy counts its real all-reduces through a comm hook: "none before the first step" must be observed.
    nosize = DataLoader(make_dataset(64), batch_sampler=_NoSizeBatchSampler(32, 8))
    return {
        "not_divisible": _error_of(rank, world_size, _strategy(30, counted=True)),
        "static_trainer_flag": _error_of(
            rank, world_size, _strategy(counted=True, static_graph=True), accumulate_grad_batches=2
        ),
        "static_global": _error_of(rank, world_size, _strategy(32, counted=True, static_graph=True)),
        "conflict": _error_of(rank, world_size, _strategy(32, counted=True), accumulate_grad_batches=3),
        "scheduler": _error_of(
            rank, world_size, _strategy(32, counted=True), callbacks=[GradientAccumulationScheduler({0: 2})]
        ),
        "unreadable": _error_of(rank, world_size, _strategy(32, counted=True), loader=nosize),
        "per_rank": _error_of(rank, world_size, _strategy(32, counted=True), batch_size=8 if rank else 4),
        "micro_mismatch": _error_of(rank, world_size, _strategy(32, counted=True, micro_batch_size=16)),
        "planned_before_optimizers": _planned_before_optimizers(rank, world_size),
    }


class _AccumulationSeenByOptimizers(BNModel):
    def __init__(self) -> None:
        super().__init__(batchnorm=False)
        self.seen: int | None = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.seen = self.trainer.accumulate_grad_batches  # what estimated_stepping_batches would divide by
        return super().configure_optimizers()


def _planned_before_optimizers(rank: int, world_size: int) -> tuple[str, int, int | None]:
    model = _AccumulationSeenByOptimizers()
    strategy = _strategy(32, counted=True)  # the plan comes from the loader's batch size (8), read at setup
    kwargs = small_trainer_kwargs(devices=world_size, strategy=strategy, use_distributed_sampler=False, max_steps=2)
    pl.Trainer(**kwargs).fit(model, make_loader(make_dataset(64), 8, rank, world_size))
    return "", strategy.comm_stats.calls, model.seen


@pytest.fixture(scope="module")
def refusals() -> list[dict[str, tuple[str, bool, int]]]:
    return run_distributed(_refusals, 2, init_process_group=False, timeout=120)


@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        (
            "not_divisible",
            [
                r"global_batch_size=30\)",
                "loaded batches of 8 x 2 data-parallel ranks",
                "16 .* or 32 ",
                "batch_size of 5 or 15",
            ],
        ),
        ("static_trainer_flag", [r"static_graph=True", r"accumulate_grad_batches=2", "Fix: pass static_graph=False"]),
        ("static_global", [r"static_graph=True", r"accumulate_grad_batches=2", "Fix"]),
        ("conflict", [r"global_batch_size=32", r"accumulate_grad_batches=2", r"Trainer\(accumulate_grad_batches=3\)"]),
        ("scheduler", ["GradientAccumulationScheduler", "Fix: drop one"]),
        ("unreadable", ["has no batch_size", r"Fix: give the DataLoader a batch_size"]),
        ("per_rank", ["differ between ranks", "from 4 to 8"]),
        ("micro_mismatch", [r"micro_batch_size=16\)", "batch_size=8"]),
    ],
)
def test_invalid_accumulation_configurations_raise_before_any_step(refusals, case, patterns):
    for message, untouched, calls in (ranks[case] for ranks in refusals):
        for pattern in patterns:
            assert re.search(pattern, message), (pattern, message)
        assert untouched and calls == 0


def test_the_accumulation_read_from_the_loader_is_set_before_configure_optimizers(refusals):
    # The loader's batch size (8) is read at setup: training runs (all-reduces issued), and the accumulation
    # (32 / (8 x 2)) is already set when configure_optimizers runs (estimated_stepping_batches divides by it).
    for ranks in refusals:
        message, calls, seen_by_optimizers = ranks["planned_before_optimizers"]
        assert message == "" and calls > 0 and seen_by_optimizers == 2


def _static_graph_first_backward_under_no_sync(rank: int, world_size: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(4, 2), static_graph=True)
    try:
        with ddp.no_sync():
            ddp(torch.randn(3, 4)).sum().backward()
        ddp(torch.randn(3, 4)).sum().backward()
    except RuntimeError as err:
        return str(err)
    return ""


def test_upstream_still_static_graph_no_sync():
    """Why AccelDDP refuses static_graph with accumulation. If this fails, torch fixed it: revisit the refusal."""
    messages = run_distributed(_static_graph_first_backward_under_no_sync, 2, timeout=60)
    assert all("expect_autograd_hooks_" in m for m in messages), messages


# ----------------------------------------------------------------------------------------------------------------
# fp16 with AccelPrecision: one unscale per step, clipping on the accumulated unscaled gradients, window-wide skip
# ----------------------------------------------------------------------------------------------------------------

CLIP = 0.05
INIT_SCALE, BACKOFF = 2.0**10, 0.5


class _OverflowModel(BNModel):
    """BNModel without BatchNorm whose inputs overflow fp16 (x 1e6 > 65504) on one chosen micro-batch."""

    def __init__(self, overflow_at: tuple[int, int, int] | None = None) -> None:
        super().__init__(batchnorm=False)
        self.overflow_at = overflow_at  # (rank, epoch, batch_idx)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.overflow_at == (self.global_rank, self.current_epoch, batch_idx):
            x = x * 1e6
        return torch.nn.functional.mse_loss(self(x).float(), y)


class _ScalerRecorder(pl.Callback):
    """Counts ``GradScaler.unscale_`` calls; records per step the gradients the hooks see and the weights."""

    def __init__(self) -> None:
        self.unscales = 0
        self.unscales_after_batch: list[int] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.before_step: list[dict[str, torch.Tensor]] = []
        self.after_batch: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = trainer.precision_plugin.scaler
        unscale = scaler.unscale_

        def counting_unscale(optimizer):
            self.unscales += 1
            return unscale(optimizer)

        scaler.unscale_ = counting_unscale

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})
        self.before_step.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        self.unscales_after_batch.append(self.unscales)
        self.after_batch.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def _fit_fp16(rank, world_size, strategy, batch_size, overflow_at=None) -> dict:
    from lit_accel import AccelPrecision, DynamicGradScaler

    pl.seed_everything(0, verbose=False)
    model = _OverflowModel(overflow_at)
    recorder = _ScalerRecorder()
    precision = AccelPrecision("16-mixed", scaler=DynamicGradScaler(init_scale=INIT_SCALE, backoff_factor=BACKOFF))
    kwargs = small_trainer_kwargs(
        max_steps=-1, max_epochs=2, gradient_clip_val=CLIP, plugins=[precision], callbacks=[recorder]
    )
    if strategy is not None:
        kwargs.update(devices=world_size, strategy=strategy, use_distributed_sampler=False)
        loader = make_loader(make_dataset(64), batch_size, rank, world_size)
    else:
        loader = make_loader(make_dataset(64), batch_size)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, loader)
    return {
        "state": params_of(model),
        "unscales_after_batch": recorder.unscales_after_batch,
        "grads": recorder.grads,
        "before_step": recorder.before_step,
        "after_batch": recorder.after_batch,
        "skipped": precision.skipped_steps,
        "scale": precision.loss_scale,
        "accumulation": trainer.accumulate_grad_batches,
    }


def _fp16_runs(rank: int, world_size: int) -> dict[str, dict]:
    # 64 samples, 8 per micro-batch on 2 ranks, global 32: windows of 2 micro-batches, 2 steps per epoch, 2 epochs.
    return {
        "clean": _fit_fp16(rank, world_size, AccelDDP(global_batch_size=GLOBAL, sync_batchnorm=False), MICRO),
        # Rank 1 overflows on the first (non-final) micro-batch of the second window of epoch 0.
        "overflow": _fit_fp16(
            rank, world_size, AccelDDP(global_batch_size=GLOBAL, sync_batchnorm=False), MICRO, overflow_at=(1, 0, 2)
        ),
    }


@pytest.fixture(scope="module")
def fp16_runs() -> list[dict[str, dict]]:
    return run_distributed(_fp16_runs, 2, init_process_group=False, timeout=120)


def test_fp16_accumulation_unscales_once_per_step_and_clips_the_accumulated_unscaled_gradients(fp16_runs):
    reference = _fit_fp16(0, 1, None, GLOBAL)  # one process, fp16, one big batch per step
    lr = BNModel().lr
    clipped_somewhere = False
    for ranks in fp16_runs:
        run = ranks["clean"]
        assert run["accumulation"] == 2 and run["skipped"] == 0
        # One unscale per optimizer step, and none on non-final micro-batches (4 micro-batches per epoch).
        assert run["unscales_after_batch"] == [0, 1, 1, 2, 2, 3, 3, 4]
        for grads, before, after in zip(run["grads"], run["before_step"], run["after_batch"][1::2]):
            # The hooks saw the accumulated gradient unscaled; SGD then applied it clipped to norm CLIP.
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
            coef = min(1.0, CLIP / (norm.item() + 1e-6))
            clipped_somewhere |= coef < 1.0
            for name in grads:
                torch.testing.assert_close((before[name] - after[name]) / lr, grads[name] * coef, rtol=1e-4, atol=1e-6)
        # The same global batch in one big fp16 batch gives the same training, up to fp16 rounding.
        for grads, expected in zip(run["grads"], reference["grads"]):
            _assert_states_close(grads, expected, atol=1e-3)
        _assert_states_close(run["state"], reference["state"], atol=1e-4)
    assert clipped_somewhere


def test_fp16_overflow_in_a_non_final_micro_batch_skips_the_whole_window_on_every_rank(fp16_runs):
    for ranks in fp16_runs:
        run, clean = ranks["overflow"], ranks["clean"]
        assert run["skipped"] == 1 and run["scale"] == INIT_SCALE * BACKOFF
        after_step = run["after_batch"][1::2]  # the weights after each optimizer step
        # Step 0 as in the clean run; step 1 (micro-batches 2 and 3, rank 1 overflowed on 2) changed nothing ...
        _assert_states_close(after_step[0], clean["after_batch"][1], atol=0)
        _assert_states_close(after_step[1], after_step[0], atol=0)
        # ... and training went on afterwards.
        assert any(not torch.equal(after_step[2][k], after_step[1][k]) for k in after_step[1])
        assert run["unscales_after_batch"] == [0, 1, 1, 2, 2, 3, 3, 4]
    _assert_states_close(fp16_runs[0]["overflow"]["state"], fp16_runs[1]["overflow"]["state"], atol=0)
