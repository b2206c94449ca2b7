"""Placeholder for :class:`AccelDDP` (built in issue #3)."""

from typing import Any


class AccelDDP:
    """Not implemented yet: see issue #3."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lit_accel.AccelDDP is not implemented yet (issue #3).")
