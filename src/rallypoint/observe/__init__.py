"""Watching a running job: progress heartbeats, hang stacks, the event log and its report.

- :func:`progress`: a worker reports that it made progress (cheap; a no-op outside a
  launch with ``hang_timeout``); the agent's :class:`ProgressBoard` reads those reports;
- :class:`EventLog` / :func:`read_events`: the ``--events`` JSON-lines log of a job;
- :func:`render_report`: that log drawn as a timeline (needs ``rallypoint[plot]``).

Importing this package loads nothing: ``progress`` is called from training loops and
``join`` imports it, so each name is imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rallypoint.observe._events import Event, EventLog, EventLogError, read_events
    from rallypoint.observe._progress import ProgressBoard, progress
    from rallypoint.observe._report import render_report

# private module -> the public names it defines (each resolved on first access)
_MODULES = {
    "_events": ("Event", "EventLog", "EventLogError", "read_events"),
    "_progress": ("ProgressBoard", "progress"),
    "_report": ("render_report",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "Event",
    "EventLog",
    "EventLogError",
    "ProgressBoard",
    "progress",
    "read_events",
    "render_report",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
