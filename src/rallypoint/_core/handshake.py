"""The mutual HMAC challenge over a job's secret, for every port that peers connect to.

The RPC port and the snapshot servers' peer port run the same exchange; a :class:`Scheme`
holds what differs (the magic, the labels, whether the client sends a hello), so a
handshake of one never passes for the other. Every field before the MAC check has a fixed
or bounded size, nothing is parsed before the MAC matches, and one deadline bounds the
whole exchange, so a peer that sends a byte now and then cannot stretch it. Errors:
:class:`HandshakeError` (the peer is not of the job, or not a server of this kind);
:class:`TimeoutError` and :class:`OSError` from the socket pass through, and each part
translates them into its own exception at its boundary.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HandshakeError",
    "Scheme",
    "ServerHandshake",
    "client_handshake",
    "recv_exact",
    "recv_into",
    "server_handshake",
]

_NONCE = 32
_MAC = 32
_MAX_HELLO = 4096
_LEN = struct.Struct("<I")
_CHUNK = 1 << 22


class HandshakeError(Exception):
    """The peer failed the challenge, closed the connection during it, or is no such server.

    ``reply``: what the server sends before it closes (the rejection, where the client's
    proof was wrong), so that the client tells a wrong secret from a server going away.
    """

    def __init__(self, message: str, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reply = reply


def _rejection(scheme: Scheme) -> bytes:
    """The server's answer to a wrong proof: as long as an acceptance, all zero bytes (an
    HMAC that is all zeros has a chance of 2**-256)."""
    return bytes(len(scheme.accept) + _MAC)


@dataclass(frozen=True, slots=True)
class Scheme:
    """What tells one kind of handshake from another.

    1. server -> client: the 8-byte magic and a 32-byte random nonce ``ns``
    2. client -> server: a nonce ``nc``; with a hello, its 4-byte length and the JSON hello;
       then ``HMAC-SHA256(secret, client_label | ns | nc | hello)``
    3. server -> client: the ``accept`` prefix and ``HMAC-SHA256(secret, server_label | nc | ns)``
    """

    what: str
    """The part's name in messages (``RPC``, ``snapshot``)."""
    magic: bytes
    client_label: bytes
    server_label: bytes
    hello: bool
    """Whether the client sends a JSON hello (its length, then its bytes)."""
    accept: bytes = b""
    """What the server's proof starts with."""

    def __post_init__(self) -> None:
        if len(self.magic) != 8:
            raise ValueError(f"magic must be 8 bytes, got {self.magic!r}")


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``: ``ConnectionError`` if the peer closes first,
    ``TimeoutError`` if ``deadline`` (``time.monotonic()``) passes first; without one,
    under the socket's own timeout."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got : min(n, got + _CHUNK)])
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes (as :func:`recv_into`)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


class ServerHandshake:
    """The server's side as a state machine fed bytes as they arrive.

    It never blocks, so one thread can run many handshakes (:mod:`._core.acceptor`): send
    :attr:`greeting`, then read at most :meth:`wanted` bytes at a time and :meth:`feed`
    them until it returns ``(reply, hello)``; send ``reply`` and the peer is trusted.
    ``hello`` is ``{}`` for a scheme without one.
    """

    def __init__(self, secret: bytes, scheme: Scheme) -> None:
        self._secret = secret
        self._scheme = scheme
        self._server_nonce = secrets.token_bytes(_NONCE)
        self.greeting = scheme.magic + self._server_nonce
        self._head = _NONCE + (_LEN.size if scheme.hello else 0)
        self._buf = bytearray()
        # grows once the hello's length is known
        self._total = self._head if scheme.hello else self._head + _MAC

    def wanted(self) -> int:
        """How many bytes the next step needs (never more than the handshake has left)."""
        return self._total - len(self._buf)

    def feed(self, data: bytes) -> tuple[bytes, dict[str, Any]] | None:
        """Take bytes; ``(reply, hello)`` once the client proved it knows the secret."""
        if len(data) > self.wanted():
            raise HandshakeError("client sent more than the handshake")
        self._buf += data
        if self._scheme.hello and len(self._buf) == self._total == self._head:
            (hello_len,) = _LEN.unpack_from(self._buf, _NONCE)
            if hello_len > _MAX_HELLO:
                raise HandshakeError(f"hello of {hello_len} bytes is larger than {_MAX_HELLO}")
            self._total = self._head + hello_len + _MAC
        if len(self._buf) < self._total:
            return None
        return self._check()

    def _check(self) -> tuple[bytes, dict[str, Any]]:
        scheme = self._scheme
        client_nonce = bytes(self._buf[:_NONCE])
        hello = bytes(self._buf[self._head : self._total - _MAC])
        mac = bytes(self._buf[self._total - _MAC :])
        expected = _mac(self._secret, scheme.client_label, self._server_nonce, client_nonce, hello)
        if not hmac.compare_digest(mac, expected):
            raise HandshakeError(
                f"client failed the HMAC challenge (wrong {scheme.what} secret)",
                reply=_rejection(scheme),
            )
        proof = _mac(self._secret, scheme.server_label, client_nonce, self._server_nonce)
        if not scheme.hello:
            return scheme.accept + proof, {}
        try:
            info = json.loads(hello)
        except ValueError as exc:
            raise HandshakeError("authenticated client sent a malformed hello") from exc
        if not isinstance(info, dict):
            raise HandshakeError("authenticated client sent a malformed hello")
        return scheme.accept + proof, info


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        return recv_exact(sock, n, deadline)
    except TimeoutError:
        raise TimeoutError("the peer did not finish authenticating in time") from None
    except ConnectionError:
        raise HandshakeError("peer closed the connection during authentication") from None


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(data)


def server_handshake(
    sock: socket.socket, secret: bytes, scheme: Scheme, deadline: float
) -> dict[str, Any]:
    """Challenge a connection (blocking) before ``deadline``; the client's hello."""
    handshake = ServerHandshake(secret, scheme)
    _send(sock, handshake.greeting, deadline)
    while True:
        data = _recv(sock, handshake.wanted(), deadline)
        try:
            done = handshake.feed(data)
        except HandshakeError as exc:
            if exc.reply:
                with contextlib.suppress(OSError):
                    _send(sock, exc.reply, deadline)
            raise
        if done is not None:
            reply, info = done
            _send(sock, reply, deadline)
            return info


def client_handshake(
    sock: socket.socket,
    secret: bytes,
    scheme: Scheme,
    deadline: float,
    hello: dict[str, Any] | None = None,
) -> None:
    """Answer the server's challenge before ``deadline`` and check that the server knows
    the secret too; ``hello`` goes with the answer where the scheme has one."""
    try:
        first = _recv(sock, len(scheme.magic) + _NONCE, deadline)
    except HandshakeError:  # before a word of the handshake: not a failed authentication
        raise ConnectionResetError(
            errno.ECONNRESET,
            f"the {scheme.what} server closed the connection before its greeting "
            "(it is shutting down, or turned the connection down)",
        ) from None
    if first[: len(scheme.magic)] != scheme.magic:
        raise HandshakeError(f"the peer is not a rallypoint {scheme.what} server")
    server_nonce = first[len(scheme.magic) :]
    client_nonce = secrets.token_bytes(_NONCE)
    body = json.dumps(hello or {}).encode() if scheme.hello else b""
    mac = _mac(secret, scheme.client_label, server_nonce, client_nonce, body)
    head = _LEN.pack(len(body)) if scheme.hello else b""
    _send(sock, client_nonce + head + body + mac, deadline)
    try:
        answer = _recv(sock, len(scheme.accept) + _MAC, deadline)
    except HandshakeError:  # a wrong secret is answered: the server went away
        raise ConnectionResetError(
            errno.ECONNRESET,
            f"the {scheme.what} server closed the connection during authentication "
            "(it is shutting down, or turned the connection down)",
        ) from None
    if answer == _rejection(scheme):
        raise HandshakeError(
            f"the {scheme.what} server turned the connection down: the {scheme.what} secrets differ"
        )
    expected = scheme.accept + _mac(secret, scheme.server_label, client_nonce, server_nonce)
    if not hmac.compare_digest(answer, expected):
        raise HandshakeError(
            f"the server failed the HMAC challenge (the {scheme.what} secrets differ)"
        )
