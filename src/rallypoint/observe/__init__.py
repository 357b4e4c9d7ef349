"""Watching a running job: progress heartbeats, hang stacks, the event log and its report.

- :func:`progress`: a worker reports that it made progress (cheap; a no-op outside a
  launch with ``hang_timeout``); the agent's :class:`ProgressBoard` reads those reports;
- :class:`EventLog` / :func:`read_events`: the ``--events`` JSON-lines log of a job;
- :func:`render_report`: that log drawn as a timeline (needs ``rallypoint[plot]``).

Importing this package loads nothing: ``progress`` is called from training loops and
``join`` imports it, so each name is imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

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
_HOME = {
    name: f"rallypoint.observe.{module}" for module, names in _MODULES.items() for name in names
}

__all__ = [
    "Event",
    "EventLog",
    "EventLogError",
    "ProgressBoard",
    "progress",
    "read_events",
    "render_report",
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _HOME)
