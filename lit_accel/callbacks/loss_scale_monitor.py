"""Placeholder for :class:`LossScaleMonitor` (built in issue #6)."""

from typing import Any


class LossScaleMonitor:
    """Not implemented yet: see issue #6."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lit_accel.LossScaleMonitor is not implemented yet (issue #6).")
