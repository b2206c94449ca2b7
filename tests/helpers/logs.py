"""Capture what a fit reports: Lightning's info-level messages, and the metrics callbacks send to loggers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.loggers import Logger

__all__ = ["CaptureLogger", "lightning_info_messages"]


class CaptureLogger(Logger):
    """An in-memory logger: ``rows`` holds (step, metrics) of every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def with_prefix(self, prefix: str) -> list[tuple[int | None, dict[str, float]]]:
        """The rows that hold at least one key starting with ``prefix``."""
        return [(s, m) for s, m in self.rows if any(k.startswith(prefix) for k in m)]

    def steps_with(self, prefix: str) -> list[int | None]:
        """The steps of the rows that hold at least one key starting with ``prefix``."""
        return [s for s, _ in self.with_prefix(prefix)]


@contextmanager
def lightning_info_messages() -> Iterator[list[str]]:
    """Yield a list that collects every message logged to ``lightning.pytorch`` at INFO or above in the block."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
