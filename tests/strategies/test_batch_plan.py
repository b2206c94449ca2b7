"""The batch plan's arithmetic (pure functions, property-tested; no processes)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lit_accel import BatchPlan
from lit_accel.layout.batch_plan import (
    loaded_batch_size_of,
    make_batch_plan,
    nearest_divisors,
    nearest_global_batch_sizes,
)
from tests.helpers import make_dataset


def _valid_globals_brute_force(global_batch_size: int, step: int) -> tuple[int, ...]:
    multiples = [j * step for j in range(1, global_batch_size // step + 2)]
    below = [m for m in multiples if m <= global_batch_size]
    above = [m for m in multiples if m >= global_batch_size]
    return tuple(sorted({*below[-1:], *above[:1]}))


def _divisors_brute_force(number: int, near: int) -> tuple[int, ...]:
    divisors = [d for d in range(1, number + 1) if number % d == 0]
    return tuple(sorted({*[d for d in divisors if d <= near][-1:], *[d for d in divisors if d >= near][:1]}))


@settings(max_examples=300, deadline=None)
@given(
    loaded=st.integers(1, 64),
    ranks=st.integers(1, 32),
    accumulation=st.integers(1, 64),
    micro=st.integers(1, 64),
)
def test_plan_recovers_the_decomposition(loaded: int, ranks: int, accumulation: int, micro: int) -> None:
    global_batch_size = loaded * ranks * accumulation
    micro = min(micro, loaded)
    plan = make_batch_plan(global_batch_size, loaded, ranks, micro)
    assert plan == BatchPlan(global_batch_size, loaded, micro, math.ceil(loaded / micro), accumulation, ranks)
    numbers = [int(n) for n in re.findall(r"\d+", plan.describe())]
    assert numbers[0] == global_batch_size == math.prod(numbers[1:4])
    assert numbers[1:4] == [loaded, accumulation, ranks]
    assert numbers[4:] == ([plan.micro_batches, micro] if plan.micro_batches > 1 else [])
    # the micro-batch never feeds the accumulation
    assert make_batch_plan(global_batch_size, loaded, ranks).accumulate_grad_batches == accumulation


@settings(max_examples=500, deadline=None)
@given(global_batch_size=st.integers(1, 4096), loaded=st.integers(1, 128), ranks=st.integers(1, 64))
def test_plan_accepts_exactly_the_divisible_sizes_and_suggests_the_nearest(
    global_batch_size: int, loaded: int, ranks: int
) -> None:
    step = loaded * ranks
    if global_batch_size % step == 0:
        assert make_batch_plan(global_batch_size, loaded, ranks).accumulate_grad_batches == global_batch_size // step
        return
    with pytest.raises(ValueError) as info:
        make_batch_plan(global_batch_size, loaded, ranks)
    message = str(info.value)
    assert f"global_batch_size={global_batch_size})" in message
    assert f"loaded batches of {loaded} x {ranks} data-parallel rank" in message
    assert "Fix:" in message
    globals_ = nearest_global_batch_sizes(global_batch_size, loaded, ranks)
    assert globals_ == _valid_globals_brute_force(global_batch_size, step)
    for size in globals_:
        assert f"global_batch_size={size}" in message or f"or {size} (" in message
        assert make_batch_plan(size, loaded, ranks).global_batch_size == size
    if global_batch_size % ranks:
        assert "no loader batch_size works" in message
    else:
        sizes = nearest_divisors(global_batch_size // ranks, loaded)
        assert sizes == _divisors_brute_force(global_batch_size // ranks, loaded)
        assert f"batch_size of {' or '.join(map(str, sizes))}." in message
        for size in sizes:
            assert make_batch_plan(global_batch_size, size, ranks).global_batch_size == global_batch_size


@settings(max_examples=200, deadline=None)
@given(loaded=st.integers(1, 256), micro=st.integers(1, 256))
def test_even_micro_batches_divide_the_loaded_batch_or_name_the_nearest(loaded: int, micro: int) -> None:
    if micro > loaded:
        with pytest.raises(ValueError, match=rf"micro_batch_size={micro}\) is larger .* batch_size={loaded}"):
            make_batch_plan(None, loaded, 1, micro, even_micro_batches=True)
        return
    if loaded % micro == 0:
        plan = make_batch_plan(None, loaded, 1, micro, even_micro_batches=True)
        assert plan.micro_batches * plan.micro_batch_size == loaded
        return
    with pytest.raises(ValueError) as info:
        make_batch_plan(None, loaded, 1, micro, even_micro_batches=True)
    choices = _divisors_brute_force(loaded, micro)
    assert f"Fix: micro_batch_size={' or '.join(map(str, choices))}." in str(info.value)
    assert make_batch_plan(None, loaded, 1, micro).micro_batches == math.ceil(loaded / micro)  # uneven is fine else


@settings(max_examples=200, deadline=None)
@given(loaded=st.integers(1, 256), count=st.integers(1, 300), ranks=st.integers(1, 8))
def test_a_micro_batch_count_splits_the_loaded_batch_equally_or_names_the_nearest(
    loaded: int, count: int, ranks: int
) -> None:
    # a pipeline's count: it wins over micro_batch_size and never feeds the accumulation
    if loaded % count == 0:
        plan = make_batch_plan(loaded * ranks, loaded, ranks, 1, micro_batches=count)
        assert plan == BatchPlan(loaded * ranks, loaded, loaded // count, count, 1, ranks)
        return
    with pytest.raises(ValueError) as info:
        make_batch_plan(None, loaded, ranks, micro_batches=count)
    choices = _divisors_brute_force(loaded, count)
    message = str(info.value)
    assert f"a loaded batch of {loaded} samples does not split into {count} equal micro-batches." in message
    assert f"Fix: {' or '.join(map(str, choices))} micro-batches per loaded batch" in message
    for choice in choices:
        assert make_batch_plan(None, loaded, ranks, micro_batches=choice).micro_batches == choice


@settings(max_examples=200, deadline=None)
@given(global_size=st.integers(1, 512), loaded=st.integers(1, 64), ranks=st.integers(1, 8))
def test_a_step_that_takes_no_accumulation_needs_one_loaded_batch_per_rank_or_names_the_sizes_that_make_it(
    global_size: int, loaded: int, ranks: int
) -> None:
    # a pipeline's step: the nearest multiples would accumulate too, so the fix names the sizes that need none
    if global_size == loaded * ranks:
        assert make_batch_plan(global_size, loaded, ranks, accumulates=False).accumulate_grad_batches == 1
        return
    with pytest.raises(ValueError) as info:
        make_batch_plan(global_size, loaded, ranks, accumulates=False)
    message = str(info.value)
    assert "so there is no accumulation. Fix: global_batch_size=" + str(loaded * ranks) in message
    per_rank = global_size // ranks
    assert (f"train dataloader batch_size of {per_rank}." in message) == (global_size % ranks == 0), message
    if global_size % ranks == 0:
        assert make_batch_plan(global_size, per_rank, ranks, accumulates=False).global_batch_size == global_size


def test_without_a_global_batch_the_trainers_accumulation_is_kept() -> None:
    plan = make_batch_plan(None, 16, 4, 4, accumulate_grad_batches=3)
    assert plan == BatchPlan(192, 16, 4, 4, 3, 4)


def test_a_contradicting_trainer_accumulation_is_refused() -> None:
    assert make_batch_plan(64, 16, 2, accumulate_grad_batches=2).accumulate_grad_batches == 2  # agrees: fine
    with pytest.raises(ValueError, match=r"gives accumulate_grad_batches=2, not Trainer\(accumulate_grad_batches=3"):
        make_batch_plan(64, 16, 2, accumulate_grad_batches=3)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, None])
def test_plan_rejects_non_positive_int_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match=r"loaded_batch_size must be a positive int"):
        make_batch_plan(32, bad, 2)  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(ValueError, match=r"micro_batch_size must be a positive int"):
            make_batch_plan(32, 16, 2, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"micro_batches must be a positive int"):
            make_batch_plan(32, 16, 2, micro_batches=bad)  # type: ignore[arg-type]


def test_with_micro_batch_size_keeps_the_step() -> None:
    plan = make_batch_plan(64, 32, 1)
    split = plan.with_micro_batch_size(12)
    assert (split.micro_batch_size, split.micro_batches) == (12, 3)
    assert (split.global_batch_size, split.accumulate_grad_batches, split.loaded_batch_size) == (64, 2, 32)
    assert plan.with_micro_batch_size(100).micro_batches == 1
    with pytest.raises(AttributeError):
        plan.micro_batch_size = 4  # type: ignore[misc]  # frozen


def test_loaded_batch_size_is_read_from_loaders() -> None:
    dataset = make_dataset(16)
    assert loaded_batch_size_of(DataLoader(dataset, batch_size=4)) == 4
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=3, drop_last=False)
    assert loaded_batch_size_of(DataLoader(dataset, batch_sampler=sampler)) == 3
    assert loaded_batch_size_of({"a": DataLoader(dataset, batch_size=4), "b": DataLoader(dataset, batch_size=4)}) == 4
    assert loaded_batch_size_of([DataLoader(dataset, batch_size=4), DataLoader(dataset, batch_size=2)]) is None
    assert loaded_batch_size_of(DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])) is None
    assert loaded_batch_size_of(DataLoader(dataset, batch_size=None)) is None
