"""Start local worker processes fast: ``rallypoint run`` and :func:`launch`.

Workers are forked from a warm process that has already imported torch, get the
environment torchrun sets, are watched by a supervisor that notices every exit at once,
and are stopped together (whole process trees) on the first failure. See
``docs/launcher.md``. This package is the launcher's face: ``launch`` and its config live
in ``rallypoint._launch``, and the layers underneath are ``rallypoint._elastic`` (attempts,
rounds, restarts), ``rallypoint._supervise`` (one node's workers), ``rallypoint._watch``
(hang stacks, the Flight Recorder, stragglers) and :mod:`rallypoint.observe` (progress,
events, report), whose public names are re-exported here.

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
"""

from typing import TYPE_CHECKING

from rallypoint._core.public import lazy_face

if TYPE_CHECKING:
    from rallypoint._core.fatal import FatalError as FatalError
    from rallypoint._core.status import JobStatus as JobStatus
    from rallypoint._core.status import WorkerStatus as WorkerStatus
    from rallypoint._elastic._errors import NodeExcludedError as NodeExcludedError
    from rallypoint._elastic._errors import RendezvousFailedError as RendezvousFailedError
    from rallypoint._elastic._errors import UnhealthyNodeError as UnhealthyNodeError
    from rallypoint._launch._api import launch as launch
    from rallypoint._launch._config import DEFAULT_PREFIX as DEFAULT_PREFIX
    from rallypoint._launch._config import LaunchConfig as LaunchConfig
    from rallypoint._launch._config import LaunchOptions as LaunchOptions
    from rallypoint._supervise._errors import BadTargetError as BadTargetError
    from rallypoint._supervise._errors import HangError as HangError
    from rallypoint._supervise._errors import LaunchError as LaunchError
    from rallypoint._supervise._errors import LaunchInterruptedError as LaunchInterruptedError
    from rallypoint._supervise._errors import LaunchTimeoutError as LaunchTimeoutError
    from rallypoint._supervise._errors import PortInUseError as PortInUseError
    from rallypoint._supervise._errors import WarmErrorKind as WarmErrorKind
    from rallypoint._supervise._errors import WarmProcessError as WarmProcessError
    from rallypoint._supervise._errors import WorkerFailedError as WorkerFailedError
    from rallypoint._supervise._errors import WorkerSummary as WorkerSummary
    from rallypoint._worker_side._restartable import RestartInterrupt as RestartInterrupt
    from rallypoint._worker_side._restartable import restartable as restartable
    from rallypoint.observe import EventLog as EventLog
    from rallypoint.observe import progress as progress
    from rallypoint.observe import read_events as read_events
    from rallypoint.observe import render_report as render_report

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

_HOMES = {
    "BadTargetError": "rallypoint._supervise._errors",
    "DEFAULT_PREFIX": "rallypoint._launch._config",
    "EventLog": "rallypoint.observe",
    "FatalError": "rallypoint._core.fatal",
    "HangError": "rallypoint._supervise._errors",
    "JobStatus": "rallypoint._core.status",
    "LaunchConfig": "rallypoint._launch._config",
    "LaunchError": "rallypoint._supervise._errors",
    "LaunchInterruptedError": "rallypoint._supervise._errors",
    "LaunchOptions": "rallypoint._launch._config",
    "LaunchTimeoutError": "rallypoint._supervise._errors",
    "NodeExcludedError": "rallypoint._elastic._errors",
    "PortInUseError": "rallypoint._supervise._errors",
    "RendezvousFailedError": "rallypoint._elastic._errors",
    "RestartInterrupt": "rallypoint._worker_side._restartable",
    "UnhealthyNodeError": "rallypoint._elastic._errors",
    "WarmErrorKind": "rallypoint._supervise._errors",
    "WarmProcessError": "rallypoint._supervise._errors",
    "WorkerFailedError": "rallypoint._supervise._errors",
    "WorkerStatus": "rallypoint._core.status",
    "WorkerSummary": "rallypoint._supervise._errors",
    "launch": "rallypoint._launch._api",
    "progress": "rallypoint.observe",
    "read_events": "rallypoint.observe",
    "render_report": "rallypoint.observe",
    "restartable": "rallypoint._worker_side._restartable",
}
"""Each name's module, imported on first access (PEP 562)."""
# WorkerState: the record's name until 0.1 (torchelastic's WorkerState is an enum of a
# whole group's state, a different thing)
_RENAMED = {"WorkerState": "WorkerSummary"}
"""An old name and its public name: the old one resolves with a ``DeprecationWarning``."""

lazy_face(__name__)  # its __getattr__ and __dir__ read _HOMES (mypy reads the imports above)
del lazy_face
