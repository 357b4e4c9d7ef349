"""Watching a running job from a worker and afterwards: progress heartbeats, the event log
and its report.

- :func:`progress`: a worker reports that it made progress (cheap; a no-op outside a
  launch with ``hang_timeout``); the agent's :class:`ProgressBoard` reads those reports;
- :class:`EventLog` / :func:`read_events`: the ``--events`` JSON-lines log of a job;
- :func:`render_report`: that log drawn as a timeline (needs ``rallypoint[plot]``).

Importing this package loads nothing: ``progress`` is called from training loops and
``join`` imports it, so each name is imported on first access. What the node's agent runs
to watch its workers (hang stacks, the Flight Recorder, stragglers, the Observer) is the
launcher side's, in ``rallypoint._watch``.
"""

from typing import TYPE_CHECKING

from rallypoint._core.public import lazy_face

if TYPE_CHECKING:
    from rallypoint.observe._events import Event as Event
    from rallypoint.observe._events import EventLog as EventLog
    from rallypoint.observe._events import EventLogError as EventLogError
    from rallypoint.observe._events import read_events as read_events
    from rallypoint.observe._progress import ProgressBoard as ProgressBoard
    from rallypoint.observe._progress import progress as progress
    from rallypoint.observe._report import render_report as render_report

__all__ = [
    "Event",
    "EventLog",
    "EventLogError",
    "ProgressBoard",
    "progress",
    "read_events",
    "render_report",
]

_HOMES = {
    "Event": "rallypoint.observe._events",
    "EventLog": "rallypoint.observe._events",
    "EventLogError": "rallypoint.observe._events",
    "ProgressBoard": "rallypoint.observe._progress",
    "progress": "rallypoint.observe._progress",
    "read_events": "rallypoint.observe._events",
    "render_report": "rallypoint.observe._report",
}
"""Each name's module, imported on first access (PEP 562)."""

lazy_face(__name__)  # its __getattr__ and __dir__ read _HOMES (mypy reads the imports above)
del lazy_face
