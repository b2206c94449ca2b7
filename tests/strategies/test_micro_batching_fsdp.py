"""``AccelFSDP(micro_batch_size="auto")``: out-of-memory anywhere in forward or backward recovered on every rank.

FSDP all-gathers in forward and reduce-scatters in backward, so these runs fail real allocations at the points where a
rank out of step would leave its peers in a collective: inside a block's forward, in backward between two
reduce-scatters, inside a collective's own call, in guarded and in recorded attempts, inside Lightning's accumulation
window, and under a capped address space. The weights must equal a run with the final micro-batch from the start.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lit_accel import AccelDDP, AccelFSDP, AccelPrecision
from lit_accel.strategies._fsdp_comm import _CountingReduceScatter
from lit_accel.utilities._compat import fsdp_can_reset_iteration
from tests.helpers import BNModel, run_distributed
from tests.strategies.test_micro_batching import _capped, _close, _fit, _reference, _run_capped

# AccelFSDP refuses "auto" where FSDP2 cannot reset a failed iteration (torch < 2.13; tested in
# test_fsdp_auto_is_refused_where_fsdp_cannot_reset_an_iteration below).
_NEEDS_RESET = pytest.mark.skipif(
    not fsdp_can_reset_iteration(), reason="needs FSDPModule.reset_iter_state (torch >= 2.13)"
)


class _FailInsideReduceScatter(pl.Callback):
    """Rank 1's reduce-scatter fails allocating inside its call, after the ledger saw it (gloo's allocates there).

    Points are ``(optimizer step, occurrence)``, counting reduce-scatters within the step on rank 1.
    """

    def __init__(self, points: list[tuple[int, int]]) -> None:
        self.points, self.seen = set(points), {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        strategy, callback = trainer.strategy, self

        class Failing(_CountingReduceScatter):
            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                         async_op: bool = False):  # fmt: skip
                step = trainer.global_step
                occurrence = callback.seen.get(step, 0)
                callback.seen[step] = occurrence + 1
                if trainer.global_rank == 1 and (step, occurrence) in callback.points:
                    callback.points.discard((step, occurrence))
                    self.ledger.before(self, output_tensor, input_tensor, group, op)
                    torch.empty(2**40, dtype=torch.uint8)  # raises: the CPU allocator cannot give a terabyte
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        failing = Failing(strategy.comm_stats, strategy._collective_ledger())
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(failing)


class _OOMAt(BNModel):
    """Real allocation failures (a terabyte) at ``(rank, optimizer step, place, occurrence)``, each once.

    Under FSDP each Linear is a shard block: "forward" fails in the second one's forward (after two all-gathers),
    "backward" in the gradient of the first one's output (after the second's reduce-scatter, before the first's).
    ``occurrence`` counts that place's passes within the step on that rank, failed attempts included.
    """

    def __init__(self, points: list[tuple[int, int, str, int]], batchnorm: bool = False) -> None:
        super().__init__(batchnorm=batchnorm)
        self.points, self.seen = set(points), {}
        self.net[3].register_forward_hook(lambda *_: self._fail("forward"))
        self.net[0].register_forward_hook(self._watch_gradient)

    def _watch_gradient(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: self._fail("backward"))

    def _fail(self, place: str) -> None:
        step, rank = self.trainer.global_step, self.trainer.global_rank
        occurrence = self.seen.get((step, place), 0)
        self.seen[(step, place)] = occurrence + 1
        if (rank, step, place, occurrence) in self.points:
            self.points.discard((rank, step, place, occurrence))
            torch.empty(2**40, dtype=torch.uint8)  # raises: the CPU allocator cannot give a terabyte


def _fsdp_recovery(rank: int, world: int) -> dict[str, Any]:
    runs = {}
    # step 0: the first (guarded) attempt of 12 fails in forward on rank 1; step 2: a recorded attempt fails in the
    # last (reduce-scattering) micro-batch's backward; step 3: a recorded attempt fails in the third forward
    one_step = [(1, 0, "forward", 0), (1, 2, "backward", 1), (1, 3, "forward", 2)]
    runs["auto"] = _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size="auto"), 12, steps=5,
                        model=lambda: _OOMAt(one_step))  # fmt: skip
    runs["fixed"] = _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size=2), 12, steps=5)
    # loaded batches of 6, Lightning accumulating 2 per step: the second loaded batch of step 1 fails (rank 1, a
    # recorded attempt), then its redo fails in its first backward (rank 0, a guarded attempt)
    window = [(1, 1, "backward", 1), (0, 1, "backward", 2)]
    runs["window"] = _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size="auto"), 6, steps=5,
                          model=lambda: _OOMAt(window))  # fmt: skip
    # the same in bf16: FSDP then holds the window's unsharded gradients in fp32 copies, which a failure must drop
    for name, micro in (("window_bf16", "auto"), ("fixed2_bf16", 2), ("fixed6_bf16", 6)):
        runs[name] = _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size=micro), 6, steps=5,
                          model=lambda points=window if micro == "auto" else []: _OOMAt(points),
                          plugins=[AccelPrecision("bf16-mixed")])  # fmt: skip
    # inside the first reduce-scatter's call: at step 0 (a guarded attempt), at step 2 (a recorded one)
    runs["in_call"] = _fit(rank, world, AccelFSDP(global_batch_size=24, micro_batch_size="auto"), 12, steps=5,
                           callbacks=[_FailInsideReduceScatter([(0, 0), (2, 0)])])  # fmt: skip
    # BatchNorm (not synchronised): the failed attempt's forward moved the running statistics, which must go back
    bn = [(1, 0, "forward", 0)]
    for name, make in (
        ("bn_fsdp", lambda m: AccelFSDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False)),
        ("bn_ddp", lambda m: AccelDDP(global_batch_size=24, micro_batch_size=m, sync_batchnorm=False,
                                      broadcast_buffers=False)),
    ):  # fmt: skip
        runs[name] = _fit(rank, world, make("auto"), 12, steps=3, model=lambda: _OOMAt(bn, batchnorm=True))
        runs[name + "_fixed"] = _fit(rank, world, make(6), 12, steps=3, model=lambda: BNModel())
    return runs


def _check_recoveries(rank: int, runs: dict[str, Any]) -> None:
    """Each failure was recovered the intended way: guarded (nothing, or the failed call, made for the peers) or
    recorded (the rest of the kept collectives made for them)."""
    mine = {name: runs[name]["recoveries"] for name in ("auto", "window", "in_call")}
    if rank == 0:
        assert mine == {"auto": [], "window": [("guarded", 0)], "in_call": []}
        return
    (g, n0), (r1, n1), (r2, n2) = mine["auto"]
    assert (g, n0, r1, r2) == ("guarded", 0, "recorded", "recorded") and n1 > 0 and n2 > n1  # n2: earlier, longer
    assert len(mine["window"]) == 1 and mine["window"][0][0] == "recorded" and mine["window"][0][1] > 0
    assert mine["in_call"][0] == ("guarded", 1) and mine["in_call"][1][0] == "recorded" and mine["in_call"][1][1] > 0


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[key] - b[key]).abs().max().item() for key in a)


@_NEEDS_RESET
def test_fsdp_recovers_from_out_of_memory_in_forward_and_backward_on_every_rank_at_the_same_step():
    reference = _reference(24, 5)
    for rank, runs in enumerate(run_distributed(_fsdp_recovery, 2, init_process_group=False, timeout=300)):
        _check_recoveries(rank, runs)
        for name in ("bn_fsdp", "bn_ddp"):
            assert runs[name]["changes"] == [(0, 12, 6)]
            _close(runs[name]["state"], runs[name + "_fixed"]["state"])  # num_batches_tracked and running stats too
        assert runs["auto"]["changes"] == [(0, 12, 6), (2, 6, 3), (3, 3, 2)] and runs["auto"]["micro"] == 2
        _close(runs["auto"]["state"], runs["fixed"]["state"])
        assert runs["window"]["changes"] == [(1, 6, 3), (1, 3, 2)] and runs["window"]["accumulation"] == 2
        _close(runs["window"]["state"], reference)
        # bf16 rounding differs with the micro-batch: within twice the gap between micro-batches of 6 and 2
        assert runs["window_bf16"]["changes"] == [(1, 6, 3), (1, 3, 2)]
        chunking = _gap(runs["fixed6_bf16"]["state"], runs["fixed2_bf16"]["state"])
        assert _gap(runs["window_bf16"]["state"], runs["fixed2_bf16"]["state"]) <= 2 * chunking
        assert runs["in_call"]["changes"] == [(0, 12, 6), (2, 6, 3)]
        _close(runs["in_call"]["state"], reference)
    _close(runs["auto"]["state"], reference)


@_NEEDS_RESET
@pytest.mark.slow
def test_fsdp_auto_finds_the_largest_micro_batch_that_fits_under_a_real_memory_cap(tmp_path):
    fsdp = ("--strategy", "fsdp")
    # Measured: 16 per device needs at most 46 MB (FSDP also gathers each block's parameters and keeps unsharded
    # gradients), 32 more than 62 MB at the first step; 54 MB leaves 8 MB either side.
    auto = _capped(tmp_path, 54, "auto", *fsdp)
    assert auto["micro"] == 16 and auto["changes"] == [(0, 32, 16)]
    # 37 MB: 16 fails too (it needs more than 42 MB), in a guarded redo. 8 needs 32-40 MB, more after the first
    # step, so a further halving may follow, at any step.
    tight = _capped(tmp_path, 37, "auto", *fsdp)
    assert tight["changes"][:2] == [(0, 32, 16), (0, 16, 8)] and tight["micro"] == tight["changes"][-1][2] <= 8
    assert all(new == old // 2 for _, old, new in tight["changes"])
    fixed = _capped(tmp_path, 1e6, "16", *fsdp)
    joint = _capped(tmp_path, 1e6, "auto", "--reference")
    for key, value in auto["state"].items():
        assert torch.allclose(value, fixed["state"][key], atol=1e-5), key
        assert torch.allclose(value, joint["state"][key], atol=1e-5), key
        assert torch.allclose(tight["state"][key], joint["state"][key], atol=1e-5), key


@_NEEDS_RESET
@pytest.mark.slow
@pytest.mark.parametrize("budget_mb", [26, 30])
def test_fsdp_auto_under_a_cap_near_the_smallest_never_hangs(tmp_path, budget_mb):
    """Caps where failures land inside gloo's own allocations, during replays, at different collectives per rank.

    gloo takes a collective's tag before allocating its buffers, so an all-gather that failed there left the peers
    waiting for ever (it did at 26 and 30 MB before the ledger allocated as much before each call). Each run must now
    finish with the joint batch's weights, or stop on every rank with a message that names the cause.
    """
    done, out = _run_capped(tmp_path, budget_mb, "auto", "--strategy", "fsdp")
    assert "HangWatchdog" not in done.stderr, done.stderr[-3000:]
    if done.returncode == 0:
        joint = _capped(tmp_path, 1e6, "auto", "--reference")
        _close(torch.load(out, weights_only=True)["state"], joint["state"])
    else:
        reasons = ("a single sample per micro-batch does not fit", "out of memory again while making the")
        assert any(reason in done.stderr for reason in reasons), done.stderr[-3000:]


@pytest.mark.skipif(fsdp_can_reset_iteration(), reason="this torch's FSDP2 resets a failed iteration: no refusal")
def test_fsdp_auto_is_refused_where_fsdp_cannot_reset_an_iteration():
    from tests.helpers import make_dataset, make_loader, small_trainer_kwargs

    strategy = AccelFSDP(global_batch_size=8, micro_batch_size="auto", sync_batchnorm=False, hang_timeout=None)
    trainer = pl.Trainer(**small_trainer_kwargs(strategy=strategy))
    with pytest.raises(ValueError, match=r"micro_batch_size='auto'\) needs FSDPModule.reset_iter_state.*Fix"):
        trainer.fit(BNModel(batchnorm=False), make_loader(make_dataset(16), 8))
