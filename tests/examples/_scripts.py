"""Helpers of the example tests: import an example script as a module; what its stderr may hold."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextmanager
def imported_example(script: Path, name: str) -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLES))


# What the examples may print on stderr: upstream lines only, each named, plus our one CPU notice (an info line).
UPSTREAM_LINES = (
    r"GPU available: .*",  # Lightning's start-up facts
    r"TPU available: .*",
    r"💡 Tip: .*",  # Lightning's advertisements for litlogger / litmodels
    r"(\[rank: \d+\] )?Seed set to \d+",  # LightningCLI's seed_everything
    r"Initializing distributed: GLOBAL_RANK: \d+, MEMBER: \d+/\d+",
    r"-{20,}",
    r"distributed_backend=gloo",
    r"All distributed processes registered\. Starting with \d+ processes",
    r"Loading `train_dataloader` to estimate number of stepping batches\.",  # the LR schedule's length
    r"`Trainer\.fit` stopped: `max_(steps|epochs)=\d+` reached\.",
    r"Restoring states from the checkpoint path at .*",
    r"Restored all states from the checkpoint at .*",
    # Lightning 2.6.6 on torch 2.14 (lightning/pytorch/utilities/_pytree.py), once per process
    r".*/lightning/pytorch/utilities/_pytree\.py:\d+: `isinstance\(treespec, LeafSpec\)` is deprecated, .*",
    # torchao on torch 2.14, at import (LightningCLI imports it while resolving lit_accel's classes)
    r"W\d+ [\d:.]+ \d+ .*torch/utils/_pytree\.py:\d+\] <enum 'KernelPreference'> is an Enum subclass .*",
)
# lit_accel's own lines the examples' defaults may print: notes (rank_zero_info), never warnings.
OUR_NOTES = (
    r"AccelDDP: global batch \d+ = .*",  # the global batch's decomposition, when one is set
)


def unexpected_stderr_lines(stderr: str, extra: tuple[str, ...] = (), notes: bool = True) -> list[str]:
    """The lines of ``stderr`` that are neither a listed upstream line nor (with ``notes``) one of our notes."""
    allowed = [re.compile(pattern) for pattern in (*UPSTREAM_LINES, *(OUR_NOTES if notes else ()), *extra)]
    return [line for line in stderr.splitlines() if line.strip() and not any(p.fullmatch(line) for p in allowed)]
