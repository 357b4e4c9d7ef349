"""rallypoint's torch-free common core: small helpers every part may import.

Nothing here imports torch, starts a thread or touches the network at import time, and
nothing here imports another rallypoint package: dependencies point down to this package,
never up from it.

- :mod:`~rallypoint._core.checks`: validation of user input (ints, durations) with messages
  that say what to change;
- :mod:`~rallypoint._core.net`: free ports and port checks;
- :mod:`~rallypoint._core.procs`: process liveness, a process's descendants (``/proc``);
- :mod:`~rallypoint._core.envvars`: the names of the environment variables rallypoint sets
  or reads, spelled once;
- :mod:`~rallypoint._core.closing`: the ``with obj:`` protocol for objects with ``close()``;
- :mod:`~rallypoint._core.lazy`: a package's lazily imported public attributes (PEP 562);
- :mod:`~rallypoint._core.public`: public names report their public module.
"""

from __future__ import annotations

from rallypoint._core.checks import check_int, check_seconds, to_timedelta
from rallypoint._core.closing import Closing
from rallypoint._core.lazy import lazy_attributes
from rallypoint._core.net import free_port, port_is_free
from rallypoint._core.procs import pid_alive
from rallypoint._core.public import set_public_module

__all__ = [
    "Closing",
    "check_int",
    "check_seconds",
    "free_port",
    "lazy_attributes",
    "pid_alive",
    "port_is_free",
    "set_public_module",
    "to_timedelta",
]
