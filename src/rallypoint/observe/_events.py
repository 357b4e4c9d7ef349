"""The ``--events FILE`` log: one JSON object per line, appended by every agent.

Each line has at least ``ts`` (unix time, float seconds) and ``kind``; the kinds the agent
writes and their fields are listed in docs/multinode.md, and ``rallypoint report`` reads
them. Several agents may append to the same file or each to its own: lines are written
with one ``write(2)`` on an ``O_APPEND`` descriptor, so whole lines never interleave.
Errors: :class:`EventLogError` (a ``ValueError``) for a malformed file, naming the file
and the line; ``TypeError``/``ValueError`` for fields that cannot be written as JSON.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint._core.checks import check_int
from rallypoint._core.closing import Closing

__all__ = ["EVENT_KINDS", "Event", "EventLog", "EventLogError", "iter_events", "read_events"]

EVENT_KINDS = frozenset(
    {
        "round",
        "members",
        "worker_start",
        "worker_exit",
        "restart",
        "hang",
        "failure",
        "straggler",
        "step_times",
        "arrival_lags",
        "job_end",
        "health",
        "spare",
        "quorum",
        "heal",
    }
)
"""The kinds the agent writes, and ``rallypoint.ft``'s workers beside it (``quorum``,
``heal``); others are allowed and carried through unchanged."""

_RESERVED = ("ts", "kind", "node", "rank", "local_rank")


class EventLogError(ValueError):
    """A line of an events file is not a valid event; ``path`` and ``lineno`` say where."""

    def __init__(self, path: str, lineno: int, reason: str) -> None:
        super().__init__(f"{path}:{lineno}: {reason}")
        self.path = path
        self.lineno = lineno
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Event:
    """One line of an events file."""

    ts: float
    kind: str
    node: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        """A free field (``event.get("round")``), or ``default`` when absent."""
        return self.fields.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object this event is written as."""
        out: dict[str, Any] = {"ts": self.ts, "kind": self.kind}
        if self.node is not None:
            out["node"] = self.node
        if self.rank is not None:
            out["rank"] = self.rank
        if self.local_rank is not None:
            out["local_rank"] = self.local_rank
        out.update(self.fields)
        return out


def _check_index(name: str, value: object) -> int | None:
    try:
        return check_int(value, name, minimum=0, allow_none=True)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}") from None


class EventLog(Closing):
    """Append events to a JSON-lines file; thread-safe, and safe to share between processes.

    ``node`` is written into every event unless an event names its own. Use as a context
    manager or call :meth:`close`. ``clock`` (default ``time.time``) is for tests.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        node: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if node is not None and not isinstance(node, str):
            raise TypeError(f"node must be a str or None, got {type(node).__name__}")
        self.path = os.fspath(path)
        self.node = node
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
        except OSError as exc:
            raise ValueError(
                f"cannot open events file {self.path!r} for appending: {exc.strerror}; "
                "pass a path in a writable directory"
            ) from exc

    def emit(
        self,
        kind: str,
        /,
        *,
        node: str | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        **fields: Any,
    ) -> Event:
        """Write one event now and return it.

        ``fields`` must be JSON-serialisable (no NaN/inf); ``ts`` and ``kind`` are set here.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty str, got {kind!r}")
        for name in ("ts", "kind"):
            if name in fields:
                raise ValueError(f"{name!r} is set by EventLog.emit; do not pass it as a field")
        event = Event(
            ts=self._clock(),
            kind=kind,
            node=node if node is not None else self.node,
            rank=_check_index("rank", rank),
            local_rank=_check_index("local_rank", local_rank),
            fields=dict(fields),
        )
        try:
            line = json.dumps(event.to_dict(), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"event {kind!r} has a field that cannot be written as JSON ({exc}); "
                "pass str/int/float/bool/None, lists or dicts of those"
            ) from exc
        data = (line + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError(f"events file {self.path!r} is closed")
            written = os.write(self._fd, data)
            while written < len(data):  # only on a full disk or a signal mid-write
                written += os.write(self._fd, data[written:])
        return event

    def close(self) -> None:
        """Close the file; later :meth:`emit` calls raise ``ValueError``."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _parse_line(path: str, lineno: int, line: str) -> Event:
    def fail(reason: str) -> EventLogError:
        return EventLogError(path, lineno, reason)

    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # from _reject_constant
        raise fail(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise fail(f"'ts' must be a finite number (unix time), got {ts!r}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise fail(f"'kind' must be a non-empty string, got {kind!r}")
    node = obj.get("node")
    if node is not None and not isinstance(node, str):
        raise fail(f"'node' must be a string, got {node!r}")
    indices: dict[str, int | None] = {}
    for name in ("rank", "local_rank"):
        value = obj.get(name)
        try:
            indices[name] = check_int(value, name, minimum=0, allow_none=True)
        except TypeError:
            raise fail(f"{name!r} must be an integer, got {value!r}") from None
        except ValueError:
            raise fail(f"{name!r} must be >= 0, got {value}") from None
    free = {k: v for k, v in obj.items() if k not in _RESERVED}
    return Event(
        ts=float(ts),
        kind=kind,
        node=node,
        rank=indices["rank"],
        local_rank=indices["local_rank"],
        fields=free,
    )


def iter_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield the events of ``path`` in file order, validating each line (blank lines skipped)."""
    spath = os.fspath(path)
    try:
        fh = open(spath, encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise EventLogError(spath, 0, f"cannot read events file: {exc.strerror}") from exc
    with fh:
        lineno = 0
        try:
            for lineno, raw in enumerate(fh, start=1):
                line = raw.strip()
                if line:
                    yield _parse_line(spath, lineno, line)
        except UnicodeDecodeError as exc:
            raise EventLogError(spath, lineno + 1, f"not UTF-8 text ({exc.reason})") from None


def read_events(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Event]:
    """Read and validate one events file, or several merged, sorted by time (stable)."""
    if isinstance(paths, str | os.PathLike):
        path_list: list[str | os.PathLike[str]] = [paths]
    else:
        path_list = list(paths)
    events: list[Event] = []
    for p in path_list:
        events.extend(iter_events(p))
    events.sort(key=lambda e: e.ts)
    return events
