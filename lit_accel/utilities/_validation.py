"""Argument checks shared by every public class, so that all error messages have one shape.

``Owner(arg=value): expected <what is allowed>. Fix: <what to pass>.`` A value of the wrong type raises ``TypeError``,
a value of the right type outside the allowed range or set raises ``ValueError`` (our style guide).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "is_number"]


def is_number(value: Any) -> bool:
    """True for ints and floats, False for bools (which are ints to Python) and everything else."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(owner: str, arg: str, value: Any, allowed: Iterable[Any], fix: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``; ``fix`` is what to pass instead.

    Example::

        >>> check_choice("AccelDDP", "partial_window", "mean", ("mean", "lightning"))
    """
    allowed = tuple(allowed)
    if value not in allowed:
        hint = f" Fix: pass {arg}={fix}." if fix else ""
        raise ValueError(f"{owner}({arg}={value!r}): expected one of {', '.join(map(repr, allowed))}.{hint}")


def check_bool(owner: str, arg: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({arg}={value!r}): expected True or False. Fix: pass {arg}=True or {arg}=False.")


def check_int(
    owner: str, arg: str, value: Any, *, minimum: int = 1, allow_none: bool = False, example: int | None = None
) -> None:
    """Raise ``TypeError`` for a non-int (bools included) and ``ValueError`` for an int below ``minimum``.

    Example::

        >>> check_int("LossScaleMonitor", "logging_interval", None, allow_none=True)
    """
    if value is None and allow_none:
        return
    expected = f"an int >= {minimum}{' or None' if allow_none else ''}"
    fix = f" Fix: pass e.g. {arg}={example if example is not None else minimum}."
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}({arg}={value!r}): expected {expected}.{fix}")
    if value < minimum:
        raise ValueError(f"{owner}({arg}={value!r}): expected {expected}.{fix}")


def check_number(
    owner: str,
    arg: str,
    value: Any,
    *,
    positive: bool = True,
    allow_none: bool = False,
    fix: str | None = None,
) -> None:
    """Raise ``TypeError`` for a non-number and ``ValueError`` for a non-finite (or, with ``positive``, ``<= 0``) one.

    Example::

        >>> check_number("EfficiencyMonitor", "peak_flops", 989e12, allow_none=True)
    """
    if value is None and allow_none:
        return
    expected = f"a finite number{' > 0' if positive else ''}{' or None' if allow_none else ''}"
    hint = f" Fix: {fix}." if fix else ""
    if not is_number(value):
        raise TypeError(f"{owner}({arg}={value!r}): expected {expected}.{hint}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{owner}({arg}={value!r}): expected {expected}.{hint}")
