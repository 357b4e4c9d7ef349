"""The mutual HMAC challenge between two snapshot servers, over the job's secret.

The same trust model as RPC (``docs/rpc.md``): the job's secret (``RALLYPOINT_RPC_SECRET``,
one per job under ``rallypoint run``) proves a peer is part of the job before a single
header is parsed. The labels differ from RPC's, so an RPC handshake never passes for a
snapshot one or the other way round:

1. server -> client: 8-byte magic, 32-byte nonce ``ns``
2. client -> server: nonce ``nc``, ``HMAC-SHA256(secret, "rallypoint-snapshot-client" | ns | nc)``
3. server -> client: ``HMAC-SHA256(secret, "rallypoint-snapshot-server" | nc | ns)``

Every read has a fixed size, and the whole exchange must finish before ``deadline``
(``time.monotonic()``), so a peer that sends nothing, or one byte a second, is dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time

from rallypoint.snapshot._wire import recv_exact

__all__ = ["AuthError", "client_handshake", "server_handshake"]

_MAGIC = b"RPSNAPA1"
_NONCE = 32
_MAC = 32


class AuthError(Exception):
    """The peer does not know the job's secret (or is not a snapshot server)."""


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise AuthError("the handshake took too long")
    sock.settimeout(left)
    try:
        return recv_exact(sock, n)
    except TimeoutError:
        raise AuthError("the handshake took too long") from None
    except ConnectionError as exc:
        raise AuthError(f"the peer closed the connection during the handshake ({exc})") from None


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    server_nonce = secrets.token_bytes(_NONCE)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(_MAGIC + server_nonce)
    data = _read(sock, _NONCE + _MAC, deadline)
    client_nonce, mac = data[:_NONCE], data[_NONCE:]
    want = _mac(secret, b"rallypoint-snapshot-client", server_nonce, client_nonce)
    if not hmac.compare_digest(mac, want):
        raise AuthError("the peer failed the HMAC challenge (not this job's secret)")
    sock.sendall(_mac(secret, b"rallypoint-snapshot-server", client_nonce, server_nonce))


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    first = _read(sock, len(_MAGIC) + _NONCE, deadline)
    if first[: len(_MAGIC)] != _MAGIC:
        raise AuthError("the peer is not a rallypoint snapshot server")
    server_nonce = first[len(_MAGIC) :]
    client_nonce = secrets.token_bytes(_NONCE)
    mac = _mac(secret, b"rallypoint-snapshot-client", server_nonce, client_nonce)
    sock.sendall(client_nonce + mac)
    try:
        answer = _read(sock, _MAC, deadline)
    except AuthError as exc:
        raise AuthError(
            f"the snapshot server refused our answer: the secrets differ ({exc})"
        ) from None
    want = _mac(secret, b"rallypoint-snapshot-server", client_nonce, server_nonce)
    if not hmac.compare_digest(answer, want):
        raise AuthError("the snapshot server failed the HMAC challenge (secrets differ)")
