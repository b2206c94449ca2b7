"""Readable numbers for end-of-fit tables and messages: FLOP/s, bytes, durations, percentages, counts.

Each formatter picks the unit from the magnitude, so a CPU run reads ``"3.21 GFLOP/s"`` rather than
``"0.00 TFLOP/s"``, and prints three significant digits. Prefixes are decimal SI throughout: 1 kB = 1e3 bytes,
1 MB = 1e6, 1 GB = 1e9 (as the monitors' ``*_gb`` keys, ``nvidia-smi``'s bandwidths and nccl-tests use), never
binary MiB/GiB. ``nan``/``inf`` are printed as such, negative values keep their sign.

Example::

    >>> format_flops_per_second(3.2e9), format_bytes(1.5e9), format_seconds(0.0123), format_percent(0.4567)
    ('3.20 GFLOP/s', '1.50 GB', '12.3 ms', '45.7%')
"""

from __future__ import annotations

import math

__all__ = [
    "format_bytes",
    "format_count",
    "format_flops",
    "format_flops_per_second",
    "format_percent",
    "format_seconds",
    "scale_for_axis",
]

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _sig3(value: float) -> str:
    """Three significant digits, keeping trailing zeros: ``3.20``, ``45.0``, ``123``, ``0.9997`` -> ``1.00``."""
    if value == 0:
        return "0"
    rounded = float(f"{value:.3g}")  # round first: the digit count follows the rounded value
    return f"{rounded:.{max(0, 2 - math.floor(math.log10(abs(rounded))))}f}"


def _si(value: float, unit: str, base_unit: str | None = None) -> str:
    if not math.isfinite(value):
        return f"{value} {unit}"
    magnitude = abs(value)
    for scale, prefix in _SI:
        # On the rounded value, so 999.7e9 reads "1.00 T..." and not "1000 G...".
        if float(_sig3(magnitude / scale)) >= 1:
            return f"{_sig3(value / scale)} {prefix}{unit}"
    return f"{_sig3(value)} {base_unit or unit}"


def scale_for_axis(largest: float, unit: str) -> tuple[float, str]:
    """The divisor and unit for an axis whose largest value is ``largest`` (in ``unit``, ``"B"`` or ``"s"``).

    Bytes take the SI prefix of the largest value (``6e3`` -> ``(1e3, "kB")``), seconds are shown in s, ms or µs; an
    axis with nothing above zero keeps the base unit. The ticks then read 0-6 kB rather than 0.000-0.006 MB.
    """
    magnitude = abs(largest) if math.isfinite(largest) else 0.0
    if unit == "s":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if magnitude >= scale:
                return scale, name
        return 1.0, "s"
    for scale, prefix in _SI:
        if magnitude >= scale:
            return scale, f"{prefix}{unit}"
    return 1.0, unit


def format_flops_per_second(flops_per_second: float) -> str:
    """``3.2e9`` -> ``"3.20 GFLOP/s"``; ``9.895e14`` -> ``"990 TFLOP/s"``; from FLOP/s up to PFLOP/s."""
    return _si(flops_per_second, "FLOP/s")


def format_flops(flops: float) -> str:
    """A FLOP count: ``6.1e12`` -> ``"6.10 TFLOP"``."""
    return _si(flops, "FLOP")


def format_bytes(num_bytes: float) -> str:
    """Decimal units by magnitude: ``512`` -> ``"512 B"``, ``1.5e9`` -> ``"1.50 GB"`` (1 GB = 1e9 bytes)."""
    return _si(num_bytes, "B")


def format_seconds(seconds: float) -> str:
    """``4.2e-5`` -> ``"42.0 µs"``, ``0.0123`` -> ``"12.3 ms"``, ``3.5`` -> ``"3.50 s"``, ``75`` -> ``"1 min 15 s"``.

    From an hour on: ``"1 h 02 min"``.
    """
    if not math.isfinite(seconds):
        return f"{seconds} s"
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s == 0:
        return "0 s"
    if s < 1e-3 and float(_sig3(s * 1e6)) < 1000:
        return f"{sign}{_sig3(s * 1e6)} µs"
    if s < 1 and float(_sig3(s * 1e3)) < 1000:
        return f"{sign}{_sig3(s * 1e3)} ms"
    if float(_sig3(s)) < 60:
        return f"{sign}{_sig3(s)} s"
    minutes, secs = divmod(round(s), 60)
    if minutes < 60:
        return f"{sign}{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours} h {minutes:02d} min"


def format_percent(fraction: float) -> str:
    """A fraction as a percentage with three significant digits: ``0.4567`` -> ``"45.7%"``, ``0.00123`` -> ``"0.123%"``.

    From 100% on, whole percents with separators (``12.5`` -> ``"1,250%"``), so a 10x error stays readable.
    """
    if not math.isfinite(fraction):
        return f"{fraction}%"
    percent = fraction * 100
    if abs(percent) >= 100:
        return f"{percent:,.0f}%"
    return f"{_sig3(percent)}%"


def format_count(count: float, decimals: int = 0) -> str:
    """Thousands separators: ``1234567`` -> ``"1,234,567"``; ``format_count(1234.56, 1)`` -> ``"1,234.6"``."""
    if not math.isfinite(count):
        return str(count)
    return f"{count:,.{decimals}f}"
