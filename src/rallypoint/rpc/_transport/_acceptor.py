"""The RPC port: a TCP and an abstract-Unix listener on :mod:`rallypoint._core.acceptor`.

Until a connection proves that it knows the job's secret it costs the worker as little as
possible (see :mod:`rallypoint._core.acceptor`). A connection to the Unix socket
(abstract: no file mode keeps other local users out) must come from a process of our uid
(``SO_PEERCRED``), checked before the greeting. Rejected connections are logged on
``rallypoint.rpc``, a few as they come, then summarised. An authenticated connection is
handed to ``on_authenticated(sock, uds, hello)`` as a blocking socket.
"""

from __future__ import annotations

import logging
import secrets
import socket

from rallypoint._core import acceptor as _core
from rallypoint._core.acceptor import MAX_PENDING, OnAuthenticated, max_pending
from rallypoint._core.handshake import ServerHandshake
from rallypoint.rpc._transport._auth import SCHEME
from rallypoint.rpc._transport._spin import WAITS

__all__ = ["MAX_PENDING", "Acceptor", "max_pending"]

logger = logging.getLogger("rallypoint.rpc")


def _log(level: int, text: str) -> None:
    logger.log(level, "rallypoint.rpc: %s", text)


class Acceptor(_core.Acceptor):
    """The worker's TCP listener on ``host`` (a free port) and its abstract Unix socket."""

    def __init__(
        self, host: str, secret: bytes, on_authenticated: OnAuthenticated, *, deadline: float
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tcp = socket.socket(family, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, 0))
        self.tcp.listen(1024)
        self.port = int(self.tcp.getsockname()[1])
        self.uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.uds_name = f"\0rallypoint-rpc-{secrets.token_hex(8)}"
        self.uds.bind(self.uds_name)
        self.uds.listen(1024)
        super().__init__(
            [self.tcp, self.uds],
            lambda: ServerHandshake(secret, SCHEME),
            on_authenticated,
            deadline=deadline,
            log=_log,
            name="rpc-accept",
            blocked=WAITS.blocked,
        )
