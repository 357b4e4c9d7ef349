"""rallypoint's torch-free common core: small helpers every part may import.

Nothing here imports torch, starts a thread or touches the network at import time, and
nothing here imports another rallypoint package: dependencies point down to this package,
never up from it.

- :mod:`~rallypoint._core.checks`: validation of user input (ints, durations) with messages
  that say what to change;
- :mod:`~rallypoint._core.net`: free ports and port checks;
- :mod:`~rallypoint._core.procs`: process liveness, a process's descendants (``/proc``),
  ending a process without finalization, child subreapers and parent-death signals;
- :mod:`~rallypoint._core.subreaper`: a command run so that nothing it starts outlives it
  (``python -m rallypoint._core.subreaper``);
- :mod:`~rallypoint._core.terminal`: a child's text made fit for a terminal (control
  characters out, lines capped);
- :mod:`~rallypoint._core.envvars`: the names of the environment variables rallypoint sets
  or reads, spelled once;
- :mod:`~rallypoint._core.closing`: the ``with obj:`` protocol for objects with ``close()``;
- :mod:`~rallypoint._core.lazy`: a package's lazily imported public attributes (PEP 562);
- :mod:`~rallypoint._core.public`: public names report their public module;
- :mod:`~rallypoint._core.blocking`: a blocking call (a C store call that ignores signals)
  run in a thread, so the caller keeps its own deadline and still handles signals;
- :mod:`~rallypoint._core.forking`: module-level locks that a forked child finds free;
- :mod:`~rallypoint._core.handshake`: the HMAC challenge over a job's secret, and
  ``recv_exact`` under one deadline;
- :mod:`~rallypoint._core.acceptor`: listeners and unauthenticated handshakes on one
  selector thread (the RPC port and the snapshot servers' peer port);
- :mod:`~rallypoint._core.peercred`: whether a Unix socket's peer runs as our uid
  (``SO_PEERCRED``);
- :mod:`~rallypoint._core.cpp_log`: torch's C++ warnings off while a store failure that
  rallypoint handles itself may come (found in the loaded library, never importing torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

if TYPE_CHECKING:
    from rallypoint._core.checks import check_int, check_seconds, to_timedelta
    from rallypoint._core.closing import Closing
    from rallypoint._core.net import free_port, port_is_free
    from rallypoint._core.procs import exit_now, pid_alive
    from rallypoint._core.public import set_public_module

# Resolved on first use: ``rallypoint/__init__`` imports this package on the launcher's
# critical path (before the warm process is forked), so it loads only ``lazy``.
_NAMES = {
    "check_int": "rallypoint._core.checks",
    "check_seconds": "rallypoint._core.checks",
    "to_timedelta": "rallypoint._core.checks",
    "Closing": "rallypoint._core.closing",
    "free_port": "rallypoint._core.net",
    "port_is_free": "rallypoint._core.net",
    "exit_now": "rallypoint._core.procs",
    "pid_alive": "rallypoint._core.procs",
    "set_public_module": "rallypoint._core.public",
}
_SUBMODULES = (
    "blocking",
    "checks",
    "closing",
    "envvars",
    "forking",
    "lazy",
    "net",
    "procs",
    "public",
    "subreaper",
    "terminal",
)

__all__ = [
    "Closing",
    "check_int",
    "check_seconds",
    "exit_now",
    "free_port",
    "lazy_attributes",
    "pid_alive",
    "port_is_free",
    "set_public_module",
    "to_timedelta",
]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _NAMES, submodules=_SUBMODULES)
