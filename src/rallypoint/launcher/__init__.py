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
    ├── WarmProcessError                  the warm process died or a ``preload`` failed
    ├── PortInUseError(ValueError)        an explicit master port is busy
    └── BadTargetError(ValueError)        the script/module/command cannot be started
"""

from __future__ import annotations

from rallypoint.launcher._api import launch
from rallypoint.launcher._config import DEFAULT_PREFIX, LaunchConfig
from rallypoint.launcher._errors import (
    BadTargetError,
    LaunchError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    PortInUseError,
    WarmProcessError,
    WorkerFailedError,
    WorkerState,
)

__all__ = [
    "DEFAULT_PREFIX",
    "BadTargetError",
    "LaunchConfig",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchTimeoutError",
    "PortInUseError",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerState",
    "launch",
]
