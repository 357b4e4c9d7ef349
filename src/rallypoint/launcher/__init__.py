"""Start local worker processes fast: ``rallypoint run`` and :func:`launch`.

Workers are forked from a warm process that has already imported torch, get the
environment torchrun sets, are watched by a supervisor that notices every exit at once,
and are stopped together (whole process trees) on the first failure. See
``docs/launcher.md``.

Exception tree::

    LaunchError(RuntimeError)
    ├── WorkerFailedError                 a worker raised, exited non-zero or died by a signal
    ├── LaunchTimeoutError(TimeoutError)  the job ran past ``LaunchConfig.timeout``
    ├── LaunchInterruptedError            the launcher got a signal and stopped the workers
    ├── HangError                         no worker reported progress for ``hang_timeout``
    ├── RendezvousFailedError             the multi-node rendezvous failed or was closed
    ├── WarmProcessError                  the warm process died or a ``preload`` failed
    ├── PortInUseError(ValueError)        an explicit master port is busy
    └── BadTargetError(ValueError)        the script/module/command cannot be started
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rallypoint._progress import progress
    from rallypoint.launcher._api import launch
    from rallypoint.launcher._config import DEFAULT_PREFIX, LaunchConfig
    from rallypoint.launcher._errors import (
        BadTargetError,
        HangError,
        LaunchError,
        LaunchInterruptedError,
        LaunchTimeoutError,
        PortInUseError,
        RendezvousFailedError,
        WarmProcessError,
        WorkerFailedError,
        WorkerState,
    )
    from rallypoint.launcher._events import EventLog, read_events
    from rallypoint.launcher._report import render_report

# Resolved on first access: ``rallypoint run`` imports ``rallypoint.launcher._warm`` and
# forks its warm process before anything else, so this package must import nothing.
_NAMES: dict[str, str] = {
    "launch": "_api",
    "DEFAULT_PREFIX": "_config",
    "LaunchConfig": "_config",
    "progress": "rallypoint._progress",  # shared with join, which must not import launch
    "EventLog": "_events",
    "read_events": "_events",
    "render_report": "_report",
    **dict.fromkeys(
        [
            "BadTargetError",
            "HangError",
            "LaunchError",
            "LaunchInterruptedError",
            "LaunchTimeoutError",
            "PortInUseError",
            "RendezvousFailedError",
            "WarmProcessError",
            "WorkerFailedError",
            "WorkerState",
        ],
        "_errors",
    ),
}

__all__ = [
    "DEFAULT_PREFIX",
    "BadTargetError",
    "EventLog",
    "HangError",
    "LaunchConfig",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchTimeoutError",
    "PortInUseError",
    "RendezvousFailedError",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerState",
    "launch",
    "progress",
    "read_events",
    "render_report",
]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        module = _NAMES[name]
        if not module.startswith("rallypoint."):
            module = f"rallypoint.launcher.{module}"
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rallypoint.launcher' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
