"""Exceptions raised by the launcher, documented and exported in ``rallypoint.launcher``
(the coordination's own, rendezvous, exclusion and health, are in ``_elastic._errors``).

The tree is drawn in ``rallypoint.launcher``'s docstring: :class:`LaunchError` (a
``RuntimeError``) is the root of everything that stops a job short of success, and
:class:`FatalError` is what a worker raises to end the job now, without restarts. Bad
user input raises ``ValueError``/``TypeError``; the CLI turns those and the
``ValueError`` subclasses here into a one-line error and exit status 2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rallypoint._core.fatal import FatalError
from rallypoint._core.status import WorkerStatus

__all__ = [
    "BadTargetError",
    "FatalError",
    "HangError",
    "LaunchError",
    "LaunchInterruptedError",
    "LaunchTimeoutError",
    "PortInUseError",
    "WarmErrorKind",
    "WarmProcessError",
    "WorkerFailedError",
    "WorkerSummary",
]


class LaunchError(RuntimeError):
    """Root of the launcher's errors."""


@dataclass(frozen=True, slots=True)
class WorkerSummary:
    """What happened to one worker in the last attempt (used in summaries)."""

    rank: int
    local_rank: int
    pid: int
    state: WorkerStatus
    exitcode: int | None
    """Like ``Popen.returncode``: negative signal number when killed by a signal."""
    detail: str
    """One human-readable line (``"exited with 3"``, ``"killed by SIGSEGV"``, ...)."""


class WorkerFailedError(LaunchError):
    """A worker failed; ``rank``/``local_rank``/``pid``/``exitcode``/``remote_traceback`` name the
    first failure by time (the root cause), ``summary`` is the launcher's failure screen."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        local_rank: int,
        pid: int,
        host: str,
        exitcode: int | None,
        remote_traceback: str,
        summary: str,
        others: tuple[WorkerSummary, ...] = (),
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.local_rank = local_rank
        self.pid = pid
        self.host = host
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback
        self.summary = summary
        self.others = others
        self.exception = exception

    def __str__(self) -> str:
        return self.summary or super().__str__()


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The job did not finish within ``LaunchConfig.timeout``; its workers were killed."""


class LaunchInterruptedError(LaunchError):
    """The launcher received a signal, forwarded it to the workers and stopped."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class HangError(LaunchError):
    """No worker reported progress for ``hang_timeout`` and no restart was left (or
    ``on_hang="fail"``); the workers' stacks were printed."""


class WarmErrorKind(enum.Enum):
    """What went wrong in the warm process (:attr:`WarmProcessError.kind`)."""

    PRELOAD = "preload"
    """A ``--preload`` module could not be imported."""
    PORT_IN_USE = "port_in_use"
    """The store could not bind its explicitly requested port: another process holds it."""
    STORE = "store"
    """The store server could not start (or restart) for another reason."""
    DIED = "died"
    """The warm process died, or its socket broke."""
    TIMEOUT = "timeout"
    """The warm process did not answer a request in time."""
    PROTOCOL = "protocol"
    """The warm process answered something unexpected."""
    SNAPSHOTS = "snapshots"
    """The node's snapshot server could not start (``rallypoint.snapshot``)."""
    NUMA = "numa"
    """torch could not say which CPUs are near the workers' GPUs (``numa_binding``)."""


class WarmProcessError(LaunchError):
    """The warm process (which imports torch and forks workers) failed; ``kind`` says how."""

    def __init__(self, message: str, *, kind: WarmErrorKind = WarmErrorKind.DIED) -> None:
        super().__init__(message)
        self.kind = kind


class PortInUseError(LaunchError, ValueError):
    """An explicitly requested master port is already in use."""

    def __init__(self, port: int, host: str = "") -> None:
        where = f"{host}:{port}" if host else str(port)
        super().__init__(
            f"master port {where} is already in use; pass a free --master-port "
            "(or none to pick a free one)"
        )
        self.port = port


class BadTargetError(LaunchError, ValueError):
    """The script, module or command to run cannot be started."""
