"""Placeholder for :class:`AccelPrecision` (built in issue #5)."""

from typing import Any


class AccelPrecision:
    """Not implemented yet: see issue #5."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lit_accel.AccelPrecision is not implemented yet (issue #5).")
