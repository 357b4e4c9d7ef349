"""Watching a running job: progress heartbeats, hang stacks, the event log and its report.

- :func:`progress`: a worker reports that it made progress (cheap; a no-op outside a
  launch with ``hang_timeout``); the agent's :class:`ProgressBoard` reads those reports;
- :class:`EventLog` / :func:`read_events`: the ``--events`` JSON-lines log of a job;
- :func:`render_report`: that log drawn as a timeline (needs ``rallypoint[plot]``).

Importing this package loads nothing: ``progress`` is called from training loops and
``join`` imports it, so each name is imported on first access.

Internal names: the launcher side (``rallypoint.supervise``, ``rallypoint.elastic``,
``rallypoint.launcher``, ``rallypoint.cli``) gets the machinery it drives from here too,
never from a private module: the :class:`Observer` of a node and its ``WatchOptions``, the
stack and Flight Recorder dumpers a worker installs, the hang report's lines, the stacks
exchange between nodes, the straggler watch and the parsers of their flags. Those resolve
on access like the public names but are not in ``__all__`` or ``dir()``: not for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import homes, lazy_attributes

if TYPE_CHECKING:
    from rallypoint.observe._events import Event, EventLog, EventLogError, read_events
    from rallypoint.observe._progress import ProgressBoard, progress
    from rallypoint.observe._report import render_report

if TYPE_CHECKING:  # internal, for the launcher side (``X as X``: re-exported, for mypy)
    from rallypoint.observe._flight._final import COLLECTIVE_TIMEOUT as COLLECTIVE_TIMEOUT
    from rallypoint.observe._flight._final import leave_final_trace as leave_final_trace
    from rallypoint.observe._flight._format import format_hang_report as format_hang_report
    from rallypoint.observe._flight._format import hang_report as hang_report
    from rallypoint.observe._flight._recorder import install_flight_dumper as install_flight_dumper
    from rallypoint.observe._flight._recorder import parse_buffer as parse_buffer
    from rallypoint.observe._observer import Observer as Observer
    from rallypoint.observe._observer import WatchOptions as WatchOptions
    from rallypoint.observe._stacks import dump_stacks_now as dump_stacks_now
    from rallypoint.observe._stacks import install_stack_dumper as install_stack_dumper
    from rallypoint.observe._stacks_exchange import StacksAnswers as StacksAnswers
    from rallypoint.observe._stacks_exchange import answer_stacks_request as answer_stacks_request
    from rallypoint.observe._stacks_exchange import latest_stacks_request as latest_stacks_request
    from rallypoint.observe._stacks_exchange import publish_node_count as publish_node_count
    from rallypoint.observe._stacks_exchange import request_stacks as request_stacks
    from rallypoint.observe._stragglers._pace import parse_threshold as parse_threshold
    from rallypoint.observe._stragglers._watch import StragglerWatch as StragglerWatch

# private module -> the public names it defines (each resolved on first access)
_MODULES = {
    "_events": ("Event", "EventLog", "EventLogError", "read_events"),
    "_progress": ("ProgressBoard", "progress"),
    "_report": ("render_report",),
}
_HOME = homes(__name__, _MODULES)

__all__ = [
    "Event",
    "EventLog",
    "EventLogError",
    "ProgressBoard",
    "progress",
    "read_events",
    "render_report",
]


# internal: private module -> the names the launcher side uses (not in ``__all__``)
_INTERNAL_MODULES = {
    "_flight._recorder": ("install_flight_dumper", "parse_buffer"),
    "_flight._final": ("COLLECTIVE_TIMEOUT", "leave_final_trace"),
    "_flight._format": ("format_hang_report", "hang_report"),
    "_observer": ("Observer", "WatchOptions"),
    "_stacks": ("dump_stacks_now", "install_stack_dumper"),
    "_stacks_exchange": (
        "StacksAnswers",
        "answer_stacks_request",
        "latest_stacks_request",
        "publish_node_count",
        "request_stacks",
    ),
    "_stragglers._watch": ("StragglerWatch",),
    "_stragglers._pace": ("parse_threshold",),
}
_INTERNAL = homes(__name__, _INTERNAL_MODULES)


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _HOME, internal=_INTERNAL)
