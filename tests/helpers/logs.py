"""Capture Lightning's info-level log messages (``rank_zero_info``) inside a block, also in a forked rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["lightning_info_messages"]


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
