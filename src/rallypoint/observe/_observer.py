"""What the agent watches besides exits: progress (hang detection), stacks and the event log.

One :class:`Observer` per agent owns the three building blocks and keeps the agent loop
free of their details:

- a :class:`~rallypoint.observe.ProgressBoard` when ``hang_timeout`` is set;
- a directory for the workers' stack dumps (``RALLYPOINT_STACKS_DIR``, always set, so that
  ``rallypoint stacks`` works on any running job);
- an :class:`~rallypoint.observe.EventLog` when ``events`` is set.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rallypoint._core.checks import check_seconds
from rallypoint._core.closing import Closing
from rallypoint.observe._events import EventLog
from rallypoint.observe._progress import ProgressBoard
from rallypoint.observe._stacks import StackDump, collect_stacks, remove_dump_file, stacks_env
from rallypoint.observe._stacks_format import format_grouped_stacks

__all__ = ["Observer", "WatchOptions"]

STACKS_TIMEOUT = 5.0
"""Seconds to wait for a worker's stack dump."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchOptions:
    """What the agent watches besides exits (``LaunchConfig`` options of the same names)."""

    hang_timeout: timedelta | None = None
    """No progress from any worker for this long is a hang (``None``: not watched)."""
    events: str | None = None
    """Append the job's events (JSON lines) to this file; ``rallypoint report`` draws them."""

    def __post_init__(self) -> None:
        check_seconds(self.hang_timeout, "hang_timeout", allow_none=True)
        if self.events is not None and not isinstance(self.events, str):
            raise TypeError(f"events must be a path, got {type(self.events).__name__}")


class Observer(Closing):
    """Progress board, stack dumps and event log of one agent."""

    def __init__(self, *, nproc: int, watch: WatchOptions, node: str) -> None:
        hang_timeout = watch.hang_timeout
        self.hang_timeout = hang_timeout
        self.node = node
        self.stacks_dir = Path(tempfile.mkdtemp(prefix="rallypoint-stacks-"))
        self.board = ProgressBoard(nproc) if hang_timeout is not None else None
        self.log: EventLog | None = None
        try:
            self.log = EventLog(watch.events, node=node) if watch.events else None
        except BaseException:
            self.close()
            raise

    def temp_paths(self) -> list[str]:
        """What this observer made in temporary directories (:meth:`close` removes it)."""
        return [str(self.stacks_dir), *([self.board.path] if self.board is not None else [])]

    def worker_env(self, local_rank: int) -> dict[str, str]:
        env = stacks_env(self.stacks_dir)
        if self.board is not None:
            env.update(self.board.env(local_rank))
        return env

    def emit(self, kind: str, /, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit(kind, **fields)

    def reset(self) -> None:
        """A new attempt/round starts: idle time counts from now."""
        if self.board is not None:
            self.board.reset()

    def hung(self) -> bool:
        return (
            self.board is not None
            and self.hang_timeout is not None
            and self.board.is_hung(self.hang_timeout)
        )

    def idle_seconds(self) -> float:
        return 0.0 if self.board is None else self.board.seconds_since_progress()

    def collect(self, pids_by_rank: Mapping[int, int]) -> dict[int, StackDump]:
        """This node's workers' stacks, keyed by global rank."""
        return collect_stacks(pids_by_rank, STACKS_TIMEOUT, directory=self.stacks_dir)

    def local_stacks_text(self, pids_by_rank: Mapping[int, int]) -> str:
        return format_grouped_stacks(self.collect(pids_by_rank))

    def forget(self, pid: int) -> None:
        remove_dump_file(self.stacks_dir, pid)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.log is not None:
            with contextlib.suppress(ValueError):
                self.log.close()
        shutil.rmtree(self.stacks_dir, ignore_errors=True)
