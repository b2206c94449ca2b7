"""Placeholder for :class:`EfficiencyMonitor` (built in issue #7)."""

from typing import Any


class EfficiencyMonitor:
    """Not implemented yet: see issue #7."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lit_accel.EfficiencyMonitor is not implemented yet (issue #7).")
