"""c10d's reverse name lookup, settled once in the warm process before it forks.

c10d names a socket's peer with ``getnameinfo`` (for its log lines) when a process makes
its first connection, and stops asking for the rest of that process's life once a lookup
fails. Where the name server never answers (containers, sandboxes), that first lookup waits
out the resolver's timeout: 1 s with ``RES_OPTIONS="timeout:1 attempts:1"``, 10 s with
glibc's defaults, in every worker at every restart and in the process that tells replica
groups a worker died. One TCPStore made and dropped here (a server on 127.0.0.1 and its own
client) costs a few ms where lookups work; where they fail it waits once, as a worker
would have, and every process forked from here (workers, replacements, the notice writer)
inherits the lookup switched off.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta

__all__ = ["settle_reverse_lookup"]

_TIMEOUT = timedelta(seconds=3)
"""What the connection may take beyond the lookup (c10d retries a failed connect until its
timeout, 300 s by default)."""


def settle_reverse_lookup() -> None:
    """Make one c10d connection in this process (nothing is left running after it)."""
    from rallypoint._core.torch_c import TCPStore

    if not _loopback_connects():
        return  # a namespace whose loopback is down: c10d would retry until its timeout
    with contextlib.suppress(Exception):  # only a speed-up: a failure changes nothing
        store = TCPStore(
            "127.0.0.1", 0, None, True, _TIMEOUT, wait_for_workers=False, use_libuv=True
        )
        del store  # its server thread ends with it: the warm process forks single-threaded


def _loopback_connects() -> bool:
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            socket.create_connection(server.getsockname(), timeout=1.0).close()
    except OSError:
        return False
    return True
