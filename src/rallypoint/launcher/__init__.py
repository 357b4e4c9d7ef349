"""Start local worker processes fast: ``rallypoint run`` and :func:`launch`.

Workers are forked from a warm process that has already imported torch, get the
environment torchrun sets, are watched by a supervisor that notices every exit at once,
and are stopped together (whole process trees) on the first failure. See
``docs/launcher.md``; the layers underneath are ``rallypoint.elastic`` (attempts, rounds,
restarts), ``rallypoint.supervise`` (one node's workers) and :mod:`rallypoint.observe`
(progress, stacks, events, report), whose public names are re-exported here.

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

Importing this package does not import torch.
"""

from __future__ import annotations

from rallypoint.launcher._api import launch
from rallypoint.launcher._config import DEFAULT_PREFIX, LaunchConfig, LaunchOptions
from rallypoint.observe import EventLog, progress, read_events, render_report
from rallypoint.supervise._errors import (
    BadTargetError,
    HangError,
    LaunchError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    PortInUseError,
    RendezvousFailedError,
    WarmErrorKind,
    WarmProcessError,
    WorkerFailedError,
    WorkerState,
)

__all__ = [
    "DEFAULT_PREFIX",
    "BadTargetError",
    "EventLog",
    "HangError",
    "LaunchConfig",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchOptions",
    "LaunchTimeoutError",
    "PortInUseError",
    "RendezvousFailedError",
    "WarmErrorKind",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerState",
    "launch",
    "progress",
    "read_events",
    "render_report",
]
