"""The node's snapshot server, forked by the warm process (``rallypoint._snapshot._server``).

The warm process binds the server's Unix socket in a fresh directory of mode 0700 (only
this user can reach it), forks the server (which serves from then on) and closes its own
copy of the socket, so that workers forked later never inherit it. The server dies with
the warm process (``PR_SET_PDEATHSIG``), which dies with the launcher: its memory is the
node's, not a worker's, and lives exactly as long as the node's part of the job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

from rallypoint._core.procs import set_parent_death_signal
from rallypoint._core.tempdirs import make_owned_dir

__all__ = ["SnapshotServer", "fork_snapshot_server", "socket_parent"]

_MAX_PATH = 100  # sockaddr_un holds 108 bytes


@dataclass(slots=True)
class SnapshotServer:
    path: str
    pid: int
    directory: str

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)


def socket_parent() -> str:
    """Where the server's directory is made: the temp dir, or ``/tmp`` when the temp dir's
    path is too long for a socket's."""
    base = tempfile.gettempdir()
    return base if len(base) < _MAX_PATH - 40 else "/tmp"


def fork_snapshot_server(close: Iterable[int]) -> SnapshotServer:
    """Fork the server; ``close``: the warm process's descriptors the child must not keep.
    Its directory names this (the warm) process as its owner (``_core.tempdirs``): the
    server dies with it."""
    directory = make_owned_dir("rallypoint-snapshots-", socket_parent())  # mode 0700
    path = os.path.join(directory, "server.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
        listener.listen(128)
        pid = os.fork()
    except BaseException:  # Ctrl-C too: socket and directory go
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    if pid == 0:
        try:
            for fd in close:
                with contextlib.suppress(OSError):
                    os.close(fd)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # a SIGTERM to every process of the job (SLURM) must leave the snapshots to the
            # workers' shutdown handlers; the server dies with the warm process (PDEATHSIG)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            set_parent_death_signal(signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)  # not in the warm process's group: never signalled with it
            from rallypoint._snapshot._server import serve

            serve(listener)
        finally:
            os._exit(1)
    listener.close()
    return SnapshotServer(path, pid, directory)
