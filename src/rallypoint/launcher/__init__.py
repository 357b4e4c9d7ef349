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
    │   └── NodeExcludedError             this node is excluded from the job (exit status 4)
    ├── UnhealthyNodeError                a health check failed: this node stayed out
    ├── WarmProcessError                  the warm process died, a ``preload`` failed, or
    │                                     the GPUs' CPUs were not found (``numa_binding``)
    ├── PortInUseError(ValueError)        an explicit master port is busy
    └── BadTargetError(ValueError)        the script/module/command cannot be started

    FatalError(Exception)                 raise it in a worker: the job ends, no restarts

Importing this package loads nothing (not torch, not its own modules): training scripts
import ``progress`` from here, so each name is imported on first access.

Internal: ``run_job`` (one job from a config and a target, with a warm process) is offered
to ``rallypoint.cli`` only; it resolves like the public names but is not in ``__all__`` or
``dir()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

if TYPE_CHECKING:
    from rallypoint._core.status import JobStatus, WorkerStatus
    from rallypoint.launcher._api import launch
    from rallypoint.launcher._config import DEFAULT_PREFIX, LaunchConfig, LaunchOptions
    from rallypoint.observe import EventLog, progress, read_events, render_report
    from rallypoint.supervise import (
        BadTargetError,
        FatalError,
        HangError,
        LaunchError,
        LaunchInterruptedError,
        LaunchTimeoutError,
        NodeExcludedError,
        PortInUseError,
        RendezvousFailedError,
        RestartInterrupt,
        UnhealthyNodeError,
        WarmErrorKind,
        WarmProcessError,
        WorkerFailedError,
        WorkerSummary,
        restartable,
    )

if TYPE_CHECKING:  # internal, for rallypoint.cli (``X as X``: re-exported, for mypy)
    from rallypoint.launcher._run import run_job as run_job

# module -> the public names it defines (each resolved on first access)
_MODULES = {
    "rallypoint.launcher._api": ("launch",),
    "rallypoint.launcher._config": ("DEFAULT_PREFIX", "LaunchConfig", "LaunchOptions"),
    "rallypoint.observe": ("EventLog", "progress", "read_events", "render_report"),
    "rallypoint.supervise": (
        "BadTargetError",
        "FatalError",
        "HangError",
        "LaunchError",
        "LaunchInterruptedError",
        "LaunchTimeoutError",
        "NodeExcludedError",
        "PortInUseError",
        "RendezvousFailedError",
        "RestartInterrupt",
        "UnhealthyNodeError",
        "WarmErrorKind",
        "WarmProcessError",
        "WorkerFailedError",
        "WorkerSummary",
        "restartable",
    ),
    "rallypoint._core.status": ("JobStatus", "WorkerStatus"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "DEFAULT_PREFIX",
    "BadTargetError",
    "EventLog",
    "FatalError",
    "HangError",
    "JobStatus",
    "LaunchConfig",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchOptions",
    "LaunchTimeoutError",
    "NodeExcludedError",
    "PortInUseError",
    "RendezvousFailedError",
    "RestartInterrupt",
    "UnhealthyNodeError",
    "WarmErrorKind",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerStatus",
    "WorkerSummary",
    "launch",
    "progress",
    "read_events",
    "render_report",
    "restartable",
]


_getattr, __dir__ = lazy_attributes(
    __name__, globals(), _HOME, internal={"run_job": "rallypoint.launcher._run"}
)


def __getattr__(name: str) -> object:
    if name == "WorkerState":  # the record's name until 0.1: torchelastic's WorkerState is
        import warnings  # an enum of a whole group's state, a different thing

        warnings.warn(
            "rallypoint.launcher.WorkerState is deprecated: it is WorkerSummary (one "
            "worker's record); the name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return _getattr("WorkerSummary")
    return _getattr(name)
