import pytest

from lit_accel.utilities._units import (
    format_bytes,
    format_count,
    format_flops,
    format_flops_per_second,
    format_percent,
    format_seconds,
    scale_for_axis,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3.2e9, "3.20 GFLOP/s"),  # a CPU run: not "0.00 TFLOP/s"
        (9.895e14, "990 TFLOP/s"),
        (2.25e15, "2.25 PFLOP/s"),
        (4.5e18, "4500 PFLOP/s"),  # past the largest prefix: more digits, same unit
        (999.7e9, "1.00 TFLOP/s"),  # rounding carries into the next prefix
        (12.0, "12.0 FLOP/s"),
        (0.0, "0 FLOP/s"),
        (-4e6, "-4.00 MFLOP/s"),
        (float("nan"), "nan FLOP/s"),
    ],
)
def test_flops_per_second_picks_the_prefix_by_magnitude(value, text):
    assert format_flops_per_second(value) == text


def test_flop_counts_use_the_same_prefixes():
    assert format_flops(6.1e12) == "6.10 TFLOP"


@pytest.mark.parametrize(
    ("value", "text"),
    [(512, "512 B"), (1_000, "1.00 kB"), (999_999, "1.00 MB"), (1.5e9, "1.50 GB"), (81559 * 2**20, "85.5 GB")],
)
def test_bytes_are_decimal_si(value, text):
    assert format_bytes(value) == text  # 1 GB = 1e9 bytes, as the monitors' *_gb keys


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (4.2e-5, "42.0 µs"),
        (0.0123, "12.3 ms"),
        (0.9996, "1.00 s"),  # 999.6 ms rounds to a full second, shown in seconds
        (3.5, "3.50 s"),
        (59.96, "1 min 00 s"),
        (75, "1 min 15 s"),
        (3725, "1 h 02 min"),
        (0, "0 s"),
        (-0.5, "-500 ms"),
        (float("inf"), "inf s"),
    ],
)
def test_seconds_pick_the_unit_by_magnitude(value, text):
    assert format_seconds(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.4567, "45.7%"), (0.00123, "0.123%"), (1.0, "100%"), (12.5, "1,250%"), (0.0, "0%"), (0.99999, "100%")],
)
def test_fractions_are_percentages_with_three_significant_digits(value, text):
    assert format_percent(value) == text


def test_counts_have_thousands_separators():
    assert format_count(1234567) == "1,234,567"
    assert format_count(1234.56, decimals=1) == "1,234.6"
    assert format_count(float("nan")) == "nan"


@pytest.mark.parametrize(
    ("largest", "unit", "expected"),
    [
        (6e3, "B", (1e3, "kB")),  # a small model's parameters: ticks 0-6 kB, not 0.000-0.006 MB
        (1.5e9, "B", (1e9, "GB")),
        (512.0, "B", (1.0, "B")),
        (0.0, "B", (1.0, "B")),  # nothing above zero: the base unit
        (0.25, "s", (1e-3, "ms")),
        (3.0, "s", (1.0, "s")),
        (4e-5, "s", (1e-6, "µs")),
        (float("nan"), "s", (1.0, "s")),
    ],
)
def test_axis_units_follow_the_largest_value(largest, unit, expected):
    assert scale_for_axis(largest, unit) == expected
