"""Who is at the other end of a local (Unix) socket: the peer's uid, from the kernel.

Linux names the process that connected to a Unix socket (``SO_PEERCRED``: its pid, uid and
gid at ``connect()`` time), whatever the socket's name. An abstract socket
(``\\0rallypoint-...``) has no file whose mode keeps other users out, so a server that
listens on one checks the uid itself. Where the platform has no ``SO_PEERCRED`` the check
passes, and the job's secret is the only one left.
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["same_user"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def same_user(sock: socket.socket) -> tuple[bool, int | None]:
    """Whether the process that connected ``sock`` (a Unix socket) runs as our uid, and
    its uid (``None`` where the kernel does not say). A socket whose peer cannot be read
    on a platform that has ``SO_PEERCRED`` fails the check."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return True, None
    try:
        _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    except OSError:
        return False, None
    return uid == os.getuid(), int(uid)
