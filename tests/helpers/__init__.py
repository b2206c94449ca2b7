"""Shared test helpers: the multi-process harness and the tiny model."""

from tests.helpers.distributed import DistributedTestError, find_free_port, run_distributed
from tests.helpers.logs import CaptureLogger, lightning_info_messages
from tests.helpers.models import BNModel, make_dataset, make_loader, params_of, small_trainer_kwargs

__all__ = [
    "BNModel",
    "CaptureLogger",
    "DistributedTestError",
    "find_free_port",
    "lightning_info_messages",
    "make_dataset",
    "make_loader",
    "params_of",
    "run_distributed",
    "small_trainer_kwargs",
]
