"""Our warnings print on one line from rank 0; a configuration error raised on every rank is said once, by rank 0.

Python prints a warning with ``warnings.formatwarning`` and an uncaught exception with ``sys.excepthook``: the tests
record a real warning raised in lit_accel's code and hand it to the first, and a real configuration error to the
second, as the interpreter does. ``tests/examples/test_vit_cli.py`` sees both in a real two-process run.
"""

from __future__ import annotations

import sys
import warnings

import pytest

from lit_accel.layout.batch_plan import make_batch_plan
from lit_accel.meters._efficiency_metrics import RankWindow
from lit_accel.meters._stragglers import StragglerWatch
from lit_accel.utilities._rank_errors import is_configuration_error, say_once
from lit_accel.utilities._warnings import rank_zero_warn

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _straggler_warnings(monkeypatch, rank: int | None) -> list[warnings.WarningMessage]:
    """A real straggler warning: StragglerWatch (meters/_stragglers.py) sees rank 1 over four times slower."""
    for key in RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", str(rank))
    rows = [RankWindow(window_s=1.0, steps=1.0, forward_s=f, busy_s=f) for f in (0.2, 0.9)]
    watch = StragglerWatch(1, rank_zero_warn, lambda: ["host-a", "host-b"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.observe(rows, has_exposed=False, threshold=0.2, step=10)
    return caught


def _printed(record: warnings.WarningMessage) -> str:
    return warnings.formatwarning(record.message, record.category, record.filename, record.lineno, record.line)


def test_our_warning_prints_on_one_line_without_the_source_line(monkeypatch):
    (record,) = _straggler_warnings(monkeypatch, rank=None)
    assert record.filename.endswith("_stragglers.py")  # attributed to the meter's line, not to the helper
    text = _printed(record)
    assert text.count("\n") == 1 and text.startswith("UserWarning: EfficiencyMeter: rank 1 on host host-b is the")
    assert "Fix:" in text and "self._warn(" not in text


def test_a_users_warning_keeps_pythons_format():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("a user's own warning", stacklevel=1)
    text = _printed(caught[0])
    assert text.startswith(f"{__file__}:") and "UserWarning: a user's own warning" in text
    assert 'warnings.warn("a user\'s own warning", stacklevel=1)' in text  # the source line, as Python prints it


def test_rank_zero_warn_is_silent_on_other_ranks(monkeypatch):
    assert _straggler_warnings(monkeypatch, rank=1) == []
    assert len(_straggler_warnings(monkeypatch, rank=0)) == 1


def _raised(fn) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return info.value


@pytest.mark.parametrize("rank", [0, 1])
def test_a_configuration_error_is_one_line_on_rank_0_and_nothing_elsewhere(monkeypatch, capsys, rank):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    error = _raised(lambda: make_batch_plan(48, 16, 2))
    assert is_configuration_error(error)
    say_once(error, rank=rank, world_size=2)
    sys.excepthook(type(error), error, error.__traceback__)  # what the interpreter calls as the process ends
    err = capsys.readouterr().err
    if rank == 0:
        assert err.count("\n") == 1 and err.startswith("ValueError: AccelDDP(global_batch_size=48) cannot be split")
        assert "Fix: global_batch_size=32" in err
    else:
        assert err == ""


def test_other_errors_and_single_processes_keep_their_traceback(monkeypatch, capsys):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    elsewhere = _raised(lambda: int("not a number"))  # raised outside lit_accel: a bug, not a configuration error
    assert not is_configuration_error(elsewhere)
    say_once(elsewhere, rank=1, world_size=2)
    single = _raised(lambda: make_batch_plan(48, 16, 2))
    say_once(single, rank=0, world_size=1)  # one process: Python's own report is already said once
    for error in (elsewhere, single):
        sys.excepthook(type(error), error, error.__traceback__)
        assert "Traceback (most recent call last)" in capsys.readouterr().err
