"""The side channel through which the ranks' watchdog threads exchange their states and the verdict.

It must keep working while the main threads block in a collective, so it never uses the process group itself:

* ``StoreChannel``: the key-value store the default process group was created with. For a ``TCPStore`` (``env://``,
  ``tcp://``, torchrun, Lightning's launchers) the watchdog opens its own client connection to the store's server:
  torch's client holds a lock for the whole of a blocking ``get``/``wait``, so sharing the process group's client
  would stall behind a main thread that waits in the store (a communicator set-up waiting for a peer).
* ``FileChannel``: one file per rank in a shared directory (single-node runs without a process group).
* ``LocalChannel``: one process, nothing to exchange.

Keys carry torchrun's run id and restart count, and a per-process count of watchdog starts (ranks start their
watchdogs in the same order), so a restarted attempt or a second ``fit`` never reads an earlier verdict.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from lit_accel.callbacks._hang_diagnosis import HangReport, RankState

__all__ = ["Channel", "FileChannel", "LocalChannel", "StoreChannel", "open_store_client"]


class Channel(Protocol):
    """What the watchdog thread needs from a side channel; every method may raise on a broken channel."""

    def publish(self, state: RankState) -> None:
        """Make ``state`` (this rank's) visible to the others."""

    def flag_overdue(self) -> None:
        """Tell the coordinator that this rank just went past its allowance."""

    def overdue_count(self) -> int:
        """How many times ranks went past their allowance so far (grows; read it to decide whether to look)."""

    def read_states(self) -> dict[int, RankState]:
        """The latest state of every rank that has published one."""

    def read_state(self, rank: int) -> RankState | None:
        """The latest state of ``rank``, if it has published one."""

    def arrive_exit(self, rank: int) -> None:
        """Count this rank as having printed the report and being ready to exit."""

    def exit_count(self) -> int:
        """How many ranks are ready to exit."""

    def post_report(self, report: HangReport) -> HangReport:
        """Post a verdict unless one exists; return the one that stands (the first posted)."""

    def read_report(self) -> HangReport | None:
        """The posted verdict, if any."""

    def close(self) -> None:
        """Release the channel's resources."""


def _namespace(generation: int) -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "-")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
    return f"lit_accel/hang_watchdog/{run}/{attempt}/{generation}/"


def open_store_client(store: Any, timeout_s: float) -> Any:
    """A new client connection to the ``TCPStore`` under ``store``'s prefixes, or ``store`` itself for other stores."""
    import torch.distributed as dist

    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store  # FileStore / HashStore: no connection to share
    return dist.TCPStore(
        inner.host, inner.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class StoreChannel:
    """Keys ``<namespace>state/<rank>``, ``<namespace>report`` and two counters, ``overdue`` and ``exit``."""

    def __init__(self, store: Any, generation: int, world_size: int) -> None:
        self.store, self.world_size = store, world_size
        self.prefix = _namespace(generation)
        self._keys = [f"{self.prefix}state/{r}" for r in range(world_size)]
        self._present: list[str] = []

    def publish(self, state: RankState) -> None:
        self.store.set(self._keys[state.rank], state.to_json())

    def flag_overdue(self) -> None:
        self.store.add(self.prefix + "overdue", 1)

    def overdue_count(self) -> int:
        return int(self.store.add(self.prefix + "overdue", 0))

    def read_states(self) -> dict[int, RankState]:
        if len(self._present) < self.world_size:  # multi_get waits for missing keys: ask only for existing ones
            self._present = [k for k in self._keys if self.store.check([k])]
        if not self._present:
            return {}
        states = (RankState.from_json(v) for v in self.store.multi_get(self._present))
        return {s.rank: s for s in states}

    def arrive_exit(self, rank: int) -> None:
        self.store.add(self.prefix + "exit", 1)

    def exit_count(self) -> int:
        return int(self.store.add(self.prefix + "exit", 0))

    def read_state(self, rank: int) -> RankState | None:
        key = self._keys[rank]
        return RankState.from_json(self.store.get(key)) if self.store.check([key]) else None

    def post_report(self, report: HangReport) -> HangReport:
        return HangReport.from_json(self.store.compare_set(self.prefix + "report", "", report.to_json()))

    def read_report(self) -> HangReport | None:
        key = self.prefix + "report"
        return HangReport.from_json(self.store.get(key)) if self.store.check([key]) else None

    def close(self) -> None:
        self.store = None


class FileChannel:
    """``state-<rank>.json`` and ``report.json`` in ``directory``; files older than this run's start are ignored."""

    def __init__(self, directory: str | os.PathLike, generation: int, world_size: int) -> None:
        self.dir = Path(directory) / _namespace(generation).replace("/", "_")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        # A peer refreshes its file every interval: one older than our start belongs to an earlier run.
        self._since = time.time() - 1.0

    def _fresh(self, path: Path) -> bool:
        try:
            return path.stat().st_mtime >= self._since
        except FileNotFoundError:
            return False

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: readers see the old or the new state, never half of one

    def publish(self, state: RankState) -> None:
        self._write(self.dir / f"state-{state.rank}.json", state.to_json())

    def flag_overdue(self) -> None:
        pass  # the coordinator reads every file every interval: few ranks on one node

    def overdue_count(self) -> int:
        return -1  # always "changed": read the states

    def read_states(self) -> dict[int, RankState]:
        states = (self.read_state(rank) for rank in range(self.world_size))
        return {s.rank: s for s in states if s is not None}

    def read_state(self, rank: int) -> RankState | None:
        path = self.dir / f"state-{rank}.json"
        if self._fresh(path):
            with contextlib.suppress(FileNotFoundError, ValueError):
                return RankState.from_json(path.read_bytes())
        return None

    def arrive_exit(self, rank: int) -> None:
        self._write(self.dir / f"exit-{rank}", b"")

    def exit_count(self) -> int:
        return sum(self._fresh(self.dir / f"exit-{rank}") for rank in range(self.world_size))

    def post_report(self, report: HangReport) -> HangReport:
        path = self.dir / "report.json"
        if path.exists() and not self._fresh(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        tmp = path.with_name(f".report.{os.getpid()}")
        tmp.write_bytes(report.to_json())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # fails if another rank posted first: theirs stands
        tmp.unlink()
        return self.read_report() or report

    def read_report(self) -> HangReport | None:
        path = self.dir / "report.json"
        if not self._fresh(path):
            return None
        with contextlib.suppress(FileNotFoundError, ValueError):
            return HangReport.from_json(path.read_bytes())
        return None

    def close(self) -> None:
        pass


class LocalChannel:
    """World size 1: the watchdog reads back its own state."""

    def __init__(self) -> None:
        self._state: RankState | None = None
        self._report: HangReport | None = None

    def publish(self, state: RankState) -> None:
        self._state = state

    def flag_overdue(self) -> None:
        pass

    def overdue_count(self) -> int:
        return -1

    def read_states(self) -> dict[int, RankState]:
        return {} if self._state is None else {self._state.rank: self._state}

    def read_state(self, rank: int) -> RankState | None:
        return self._state

    def arrive_exit(self, rank: int) -> None:
        pass

    def exit_count(self) -> int:
        return 1

    def post_report(self, report: HangReport) -> HangReport:
        self._report = self._report or report
        return self._report

    def read_report(self) -> HangReport | None:
        return self._report

    def close(self) -> None:
        pass
