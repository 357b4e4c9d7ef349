"""The mutual HMAC challenge between two snapshot servers, over the job's secret.

The same trust model as RPC (``docs/rpc.md``): the job's secret (``RALLYPOINT_RPC_SECRET``)
proves a peer is part of the job before a single header is parsed. The exchange is
:mod:`rallypoint._core.handshake`'s, without a hello and with labels of its own
(``rallypoint-snapshot-client``/``-server``), so an RPC handshake never passes for a
snapshot one or the other way round. Every read has a fixed size and the whole exchange a
deadline, so a slow or silent peer is dropped. The server's side runs in
:mod:`rallypoint._core.acceptor`; this module gives the scheme and the client's side,
whose failures are :class:`AuthError`.
"""

from __future__ import annotations

import socket

from rallypoint._core import handshake as _handshake
from rallypoint._core.handshake import HandshakeError, Scheme

__all__ = ["SCHEME", "AuthError", "client_handshake"]

SCHEME = Scheme(
    what="snapshot",
    magic=b"RPSNAPA1",
    client_label=b"rallypoint-snapshot-client",
    server_label=b"rallypoint-snapshot-server",
    hello=False,
)


class AuthError(Exception):
    """The peer does not know the job's secret (or is not a snapshot server)."""


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Prove to a snapshot server that we know ``secret``, and check that it does."""
    try:
        _handshake.client_handshake(sock, secret, SCHEME, deadline)
    except HandshakeError as exc:
        raise AuthError(str(exc)) from None
    except TimeoutError:
        raise AuthError("the handshake took too long") from None
