"""The messages between the supervisor and its warm process, one pickled dataclass a packet.

Each request of the supervisor has its reply (:class:`Init` -> :class:`Ready`,
:class:`Spawn` -> :class:`Spawned`, ...) or :class:`Failed`; :class:`Shutdown` and
:class:`RemoveOnExit` have none. Unsolicited, the warm process sends :class:`Exited` the
moment a worker is reaped. The warm process and its store process speak
:class:`StartStore`/:class:`ResetStore` -> :class:`StoreStarted` | :class:`Failed` too.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rallypoint._supervise._errors import WarmErrorKind

if TYPE_CHECKING:
    from rallypoint._supervise._worker import WorkerSpec

__all__ = [
    "MAX_MESSAGE",
    "CpusFound",
    "Exited",
    "Failed",
    "FindCpus",
    "Init",
    "Ready",
    "RemoveOnExit",
    "Reply",
    "Request",
    "ResetStore",
    "Shutdown",
    "SnapshotsStarted",
    "Spawn",
    "Spawned",
    "StartSnapshots",
    "StartStore",
    "StoreStarted",
    "recv",
    "send",
]

MAX_MESSAGE = 1 << 22
"""Largest packet (a worker spec carries its whole environment)."""


# ---------------------------------------------------------------- supervisor -> warm process
@dataclass(frozen=True, slots=True)
class Init:
    """Import these modules, freeze the heap, and answer :class:`Ready`."""

    preload: tuple[str, ...]
    later: bool = True
    """Import what a worker's first step imports once idle (a job that may fork workers
    later: restarts, spares)."""


@dataclass(frozen=True, slots=True)
class StartStore:
    """Start the job's TCPStore server on ``host:port`` (0: a free port)."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class ResetStore:
    """Replace the store server by an empty one on the same port (a restart)."""


@dataclass(frozen=True, slots=True)
class Spawn:
    """Fork one worker; its stdout, stderr and result pipes travel with the message."""

    spec: WorkerSpec


@dataclass(frozen=True, slots=True)
class StartSnapshots:
    """Start the node's snapshot server (once; ``rallypoint.snapshot``)."""


@dataclass(frozen=True, slots=True)
class FindCpus:
    """Which CPUs each local rank binds to under ``numa_binding`` (``_numa_probe``)."""

    mode: str
    nproc: int
    env: dict[str, str]
    """The workers' environment: CUDA reads its ``CUDA_VISIBLE_DEVICES`` there."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Kill every worker, the store and the snapshot server, then exit."""


@dataclass(frozen=True, slots=True)
class RemoveOnExit:
    """Temporary files and directories of the supervisor: if it dies without a
    :class:`Shutdown` (``kill -9``, the OOM killer), the warm process removes them."""

    paths: tuple[str, ...]


Request = (
    Init | StartStore | ResetStore | Spawn | StartSnapshots | FindCpus | Shutdown | RemoveOnExit
)


# ---------------------------------------------------------------- warm process -> supervisor
@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class StoreStarted:
    port: int
    pid: int
    """The store process (never signalled with the workers)."""


@dataclass(frozen=True, slots=True)
class SnapshotsStarted:
    path: str
    """The server's Unix socket (in a directory only this user can enter)."""
    pid: int
    replaced: str = ""
    """How the previous server ended (``"killed by SIGKILL"``) when this one replaces it."""


@dataclass(frozen=True, slots=True)
class CpusFound:
    cpus: tuple[frozenset[int], ...]
    """One set per local rank."""


@dataclass(frozen=True, slots=True)
class Spawned:
    local_rank: int
    pid: int


@dataclass(frozen=True, slots=True)
class Failed:
    kind: WarmErrorKind
    text: str


@dataclass(frozen=True, slots=True)
class Exited:
    """A worker was reaped; ``status`` is its ``waitpid`` status."""

    pid: int
    status: int


Reply = Ready | StoreStarted | SnapshotsStarted | CpusFound | Spawned | Failed | Exited


def send(sock: socket.socket, msg: Request | Reply, fds: list[int] | None = None) -> None:
    data = pickle.dumps(msg)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[Request | Reply | None, list[int]]:
    """One message and the descriptors sent with it; ``None`` when the peer closed."""
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
    else:
        data, fds = sock.recv(MAX_MESSAGE), []
    if not data:
        return None, list(fds)
    return decode(data), list(fds)


_TYPES = (
    Init,
    StartStore,
    ResetStore,
    Spawn,
    StartSnapshots,
    FindCpus,
    Shutdown,
    RemoveOnExit,
    Ready,
    StoreStarted,
    SnapshotsStarted,
    CpusFound,
    Spawned,
    Failed,
    Exited,
)


def decode(data: bytes) -> Request | Reply:
    msg = pickle.loads(data)
    assert isinstance(msg, _TYPES), f"not a warm-process message: {msg!r}"
    return msg
