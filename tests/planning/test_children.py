"""The forked children ``lit_accel.plan`` measures in: results in order, from other processes, failures raised."""

from __future__ import annotations

import os

import pytest

from lit_accel.planning._peak import in_children


def _where(item: int) -> tuple[int, int]:
    return item * item, os.getpid()


def test_results_come_back_in_order_from_processes_other_than_this_one():
    results = in_children(_where, list(range(7)))
    assert [value for value, _ in results] == [i * i for i in range(7)]
    assert os.getpid() not in {pid for _, pid in results}


def test_a_failing_item_is_raised_here_with_its_error_after_every_child_has_ended():
    with pytest.raises(RuntimeError, match="measuring the layouts failed: ZeroDivisionError"):
        in_children(lambda item: 1 / item, [1, 0, 2])
    assert in_children(_where, [3])[0][0] == 9  # no child left behind holds the next call up
