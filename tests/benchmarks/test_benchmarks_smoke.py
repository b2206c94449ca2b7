"""Smoke tests of the benchmark scripts: each runs from the command line, as README says, and writes its JSON.

The benchmarks themselves are never collected (pytest's testpaths is ``tests/``); these tests run their tiny modes in a
subprocess and check what the scripts compute that must hold whatever the machine's speed: the gpu_check dry run's
verdicts, the all-reduce byte counts of the accumulation benchmark, the activation memory that autocast halves, the
scaling baseline. Timing numbers are never asserted. The multi-process ones are marked ``slow`` (``pytest -m slow``)
to keep the default run under a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, tmp_path: Path, *args: str, timeout: float = 240) -> tuple[dict[str, Any], str]:
    out = tmp_path / f"{Path(script).stem}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["benchmark"] == Path(script).stem
    assert result["command"].startswith(f"python benchmarks/{script}")
    assert out.with_suffix(".md").read_text().count("|") > 4  # the markdown table next to the JSON
    return result, proc.stdout


@pytest.mark.slow  # minutes on 2 cores (both parts, 3 compiled arms); CI's floor environment runs it too
@pytest.mark.timeout(480)
def test_gpu_check_dry_run_passes_and_prints_the_table_last(tmp_path):
    # Both parts (the default), as the lent GPU machine runs them in two calls; the JSON is rewritten after each check.
    result, stdout = _run("gpu_check.py", tmp_path, "--dry-run", "--peak-tflops", "1", timeout=420)
    assert result["mode"] == "dry-run (CPU)" and result["complete"]
    assert set(result["seconds_per_check"]) == {*result["checks"]} and len(result["checks"]) == 10
    verdicts = {row["check"]: row["result"] for row in result["rows"]}
    assert result["passed"], verdicts
    # Every check ran to its own rows (a crashing check collapses into one FAIL row named after it).
    assert sum(name.startswith("fp16 loss scaling") for name in verdicts) == 2
    assert verdicts["fp16 underflow rescued by scaling"] == "PASS"
    assert [v for k, v in verdicts.items() if k.startswith("syncs/step")] == ["PASS"] * 4
    assert verdicts["SyncBN portable == BatchNorm(joint batch)"] == "PASS"
    assert verdicts["SyncBN 'auto' implementation"] == "PASS"
    assert verdicts["fp8-mixed trains a batch of 3"] == "PASS"  # 15 rows, padded as on FP8 tensor cores
    assert verdicts["pipeline stage under compile + FP8"] == "PASS"  # AccelParallel's check (10)
    assert verdicts["bubble meter on the host clock"] == "PASS"
    # Fused optimizers: nothing added; the positive control shows the counter sees the one documented host read.
    syncs = result["details"]["syncs"]
    assert syncs["16-mixed, fused AdamW"]["added_per_step"] == 0
    assert syncs["bf16-mixed, fused AdamW, NonFiniteGuard(action='raise')"]["added_per_step"] == 0
    assert syncs["bf16-mixed, AdamW (control), NonFiniteGuard(action='raise')"]["added_per_step"] == 1
    # The MFU path ran (a peak was given), for the script's own count and the EfficiencyMonitor's.
    vit = result["details"]["vit"]
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        assert vit[precision]["mfu"] > 0
        assert vit[precision]["efficiency_monitor_mfu"] > 0
    # The short table is the last thing printed.
    assert stdout.rstrip().splitlines()[-1].startswith("└")


def test_amp_tiny_writes_three_arms_and_autocast_halves_saved_activations(tmp_path):
    result, stdout = _run("amp.py", tmp_path, "--tiny")
    assert json.loads(stdout) == result  # the JSON is printed too
    arms = result["arms"]
    assert set(arms) == {"fp32", "bf16", "fp16"}
    assert all(arm["images_per_s"]["median"] > 0 for arm in arms.values())
    # Autocast saves 16-bit activations for the backward: well under fp32's (parameters' casts aside).
    for arm in ("bf16", "fp16"):
        assert arms[arm]["saved_activations_mb"] < 0.75 * arms["fp32"]["saved_activations_mb"]


@pytest.mark.slow
def test_accumulation_tiny_counts_one_all_reduce_round_per_optimizer_step(tmp_path):
    result, _ = _run("accumulation.py", tmp_path, "--tiny")
    grad_bytes = result["setup"]["fp32_gradient_bytes"]
    assert grad_bytes == 4 * result["setup"]["parameters"]
    k2 = result["per_k"]["2"]
    # AccelDDP (Lightning's no_sync) reduces once per optimizer step; the naive loop once per micro-batch. The
    # accel_ddp arm runs without a comm hook: DDP's reducer itself counts one synchronised iteration per step, and
    # the counters derived from AccelDDP's rounds agree with the hook-counted arms.
    assert k2["accel_ddp"]["ddp_sync_iterations_per_step"] == 1
    assert k2["accel_ddp"]["allreduce_bytes_per_step"] == grad_bytes
    assert k2["raw_no_sync"]["allreduce_bytes_per_step"] == grad_bytes
    assert k2["naive"]["allreduce_bytes_per_step"] == 2 * grad_bytes
    assert k2["accel_ddp_bf16"]["allreduce_bytes_per_step"] == grad_bytes / 2
    assert k2["naive"]["allreduce_calls_per_step"] == 2 * k2["accel_ddp"]["allreduce_calls_per_step"]
    # The fp32 arms do the same math: same weights at the end.
    for arm in ("raw_no_sync", "accel_ddp"):
        assert k2[arm]["max_param_diff_vs_naive"] < 1e-5


@pytest.mark.slow
def test_overhead_tiny_reports_the_overhead_ratio(tmp_path):
    result, _ = _run("overhead.py", tmp_path, "--tiny")
    assert set(result["arms"]) == {"raw", "lightning", "lit_accel", "full_stack", "accel_fsdp", "model_parallel"}
    assert result["overhead_ratio"] == result["ratios"]["lit_accel/lightning"]["median_step"]["median"] > 0
    assert result["overhead_ratio_cpu_time"] == result["ratios"]["lit_accel/lightning"]["cpu"]["median"] > 0
    assert result["full_stack_ratio"] == result["ratios"]["full_stack/lightning"]["median_step"]["median"] > 0
    assert result["ratios"]["accel_fsdp/model_parallel"]["median_step"]["median"] > 0
    assert isinstance(result["target_met"], bool) and isinstance(result["full_stack_target_met"], bool)


@pytest.mark.slow
def test_fsdp_tiny_reports_its_ratios_and_sharded_state(tmp_path):
    result, _ = _run("fsdp.py", tmp_path, "--tiny")
    two = result["results"]["2"]
    assert set(two["median_step_ms"]) == {"accel_fsdp", "model_parallel", "accel_ddp", "accel_fsdp_auto"}
    for ratio in ("accel_fsdp/model_parallel", "accel_fsdp/accel_ddp", "accel_fsdp_auto/accel_fsdp"):
        assert two[ratio]["median"] > 0
    state = two["per_rank_state_mb"]  # 2 ranks hold half of what DDP holds, "auto" or not
    assert state["accel_fsdp"] == state["accel_fsdp_auto"] == state["model_parallel"] < 0.6 * state["accel_ddp"]


@pytest.mark.slow
def test_compile_tiny_reports_compiled_over_eager(tmp_path):
    result, _ = _run("compile.py", tmp_path, "--tiny")
    assert set(result["arms"]) == {"lit_accel", "lit_accel_compiled"}
    assert result["compiled_over_eager"] == result["ratios"]["lit_accel_compiled/lit_accel"]["median_step"]["median"]
    assert result["compiled_over_eager"] > 0
    assert "compiled / eager median step" in (tmp_path / "compile.md").read_text()


@pytest.mark.slow
def test_scaling_tiny_writes_the_plot_and_a_unit_baseline(tmp_path):
    result, _ = _run("scaling.py", tmp_path, "--tiny")
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    for mode in ("weak", "strong"):
        assert result["measured"][mode]["1"]["efficiency"]["median"] == 1.0
    curves = result["predicted"]["curves"]
    # More devices on the same link can only lose efficiency in the ring model.
    for curve in curves.values():
        weak = [curve["weak"][n] for n in sorted(curve["weak"], key=int)]
        assert weak == sorted(weak, reverse=True)


@pytest.mark.slow
def test_syncbn_tiny_measures_three_cases_their_communication_limit_and_the_ratio_to_it(tmp_path):
    result, _ = _run("syncbn.py", tmp_path, "--tiny")
    cases = result["cases"]
    assert list(cases) == ["nchw", "channels_last", "bn1d"]
    assert [cases[c]["memory_format"] for c in cases] == ["contiguous", "channels_last", "contiguous"]
    assert cases["bn1d"]["input_per_rank"] == [16, 32]
    for case in cases.values():
        assert case["ratio_portable_over_local"]["n"] == result["setup"]["reps"] == 3
        # (local + the two bare collectives) / local: above 1 whatever the machine's speed.
        assert case["communication_limit_ratio"]["min"] > 1
        # The target and its CPU-time and collectives-in-place companions, per case, paired per repetition.
        for key in ("ratio_portable_over_local_plus_all_reduces", "ratio_portable_over_bn_with_all_reduces"):
            assert case[key]["n"] == case[f"cpu_{key}"]["n"] == 3 and case[key]["min"] > 0
        assert set(case["median_ms"]) >= {"all_reduces_fwd_bwd", "bn_with_all_reduces_fwd_bwd"}
        # Local BatchNorm: its forward and backward kernels; the portable layer dispatches more, but a bounded number.
        ops = case["aten_ops_per_step"]
        assert 2 <= ops["local_bn"] < ops["portable_syncbn"] <= 60, ops
    # The script's original keys are the nchw case's.
    assert result["median_ms"] == cases["nchw"]["median_ms"]
    assert result["ratio_portable_over_local"] == cases["nchw"]["ratio_portable_over_local"]["median"]
    assert set(result["median_ms"]) >= {"local_bn_fwd_bwd", "portable_syncbn_fwd_bwd", "all_reduce_2C+1_fp64"}


@pytest.mark.slow
def test_memory_tiny_shows_each_lever_saving_memory_per_rank(tmp_path):
    result, _ = _run("memory.py", tmp_path, "--tiny")
    arms = result["arms"]
    assert set(arms) == {f"{s}/{p}" for s in ("ddp", "fsdp", "fsdp_ac") for p in ("fp32", "bf16", "fp16")}
    ddp, fsdp = arms["ddp/fp32"]["max_over_ranks_mb"], arms["fsdp/fp32"]["max_over_ranks_mb"]
    assert ddp["grads"] == ddp["params"] > 0 and ddp["optimizer"] > 1.99 * ddp["params"]  # fp32 grads, AdamW moments
    for key in ("params", "grads", "optimizer"):  # sharded over 2 ranks (the largest rank's share of uneven shards)
        assert fsdp[key] < 0.6 * ddp[key]
    assert fsdp["activations"] == ddp["activations"]  # FSDP2's gathered parameters are not activations
    for strategy in ("ddp", "fsdp", "fsdp_ac"):
        fp32 = arms[f"{strategy}/fp32"]["max_over_ranks_mb"]["activations"]
        for half in ("bf16", "fp16"):
            assert arms[f"{strategy}/{half}"]["max_over_ranks_mb"]["activations"] < 0.75 * fp32
    assert arms["fsdp_ac/fp32"]["max_over_ranks_mb"]["activations"] < 0.5 * fsdp["activations"]
    casts = {arm: arms[arm]["max_over_ranks_mb"]["param_casts"] for arm in ("ddp/bf16", "fsdp/bf16")}
    assert casts["ddp/bf16"] > 0 and casts["fsdp/bf16"] == 0  # autocast's weight copies; FSDP2 gathers bf16 instead


@pytest.mark.slow
def test_host_cost_tiny_pairs_every_arm_with_its_references_and_checks_the_limits(tmp_path):
    result, _ = _run("host_cost.py", tmp_path, "--tiny")
    run = result["world_sizes"]["1"]
    assert {
        "ddp_again - ddp",
        "accel_ddp - ddp",
        "accel_fp16 - ddp_fp16",
        "full - ddp_fp16",
        "full - accel_fp16",
    } <= set(run["differences"])
    assert [(a["arm"], a["baseline"]) for a in run["acceptance"]] == [
        ("accel_fp16", "ddp_fp16"), ("full", "ddp_fp16"), ("accel_ddp", "ddp")
    ]  # fmt: skip
    assert all(d["arm_cpu_ms"]["median"] > 0 and d["ref_cpu_ms"]["median"] > 0 for d in run["differences"].values())


def test_lockstep_turns_alternate_one_step_each_and_a_failing_job_neither_hangs_nor_hides(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _lockstep

    order: list[tuple[int, int]] = []

    def job(steps: int, fail_at: int | None = None) -> Any:
        def run(turns: Any, me: int) -> int:
            for step in range(steps):
                order.append((me, step))
                if step == fail_at:
                    raise RuntimeError(f"job {me} failed")
                turns.hand_over(me)
            return me

        return run

    assert _lockstep.run_in_turns([job(3), job(5)]) == [0, 1]
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]  # the longer one finishes alone
    order.clear()
    with pytest.raises(RuntimeError, match="job 1 failed"):
        _lockstep.run_in_turns([job(4), job(4, fail_at=1)])
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (0, 3)]


@pytest.mark.slow
def test_plan_cost_tiny_plans_every_case_and_the_gpt_state_is_the_closed_form(tmp_path):
    result, _ = _run("plan_cost.py", tmp_path, "--tiny")
    cases = {case["case"]: case for case in result["cases"]}
    assert set(cases) == {"vit_example-2", "vit_example-8", "gpt_7b-64"}
    for case in cases.values():
        assert case["layouts"] > case["refused"] >= 0 and case["seconds"] > 0
    # the ViT example has no pipeline_loss: its pipeline rows are refused, the others planned
    rows = {row["name"]: row for row in cases["vit_example-2"]["rows"]}
    assert rows["pp2"]["refused"] and rows["fsdp+ac"]["refused"] is None
    # the tiny GPT's vocabulary and widths do not divide 64 shards: FSDP's rounded-up shards stay within a few %
    errors = cases["gpt_7b-64"]["closed_form_error"]
    assert all(abs(e) < 1e-3 for e in errors["ddp"].values()), errors
    assert all(0 <= e < 0.05 for e in errors["fsdp"].values()), errors
