"""A dispatch mode that records every tensor operation run under it: proof that a hot path does no tensor work."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Records the name of each ATen op dispatched while active (``with OpRecorder() as rec: ...; rec.ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
