"""Per-job secret and the HMAC challenge every connection answers before it is trusted.

Threat model: anyone who can open a TCP connection to a worker (or the abstract Unix
socket, inside the same network namespace) could otherwise make it unpickle arbitrary
bytes, which is arbitrary code execution (torch's RPC has exactly this hole,
CVE-2024-5480). Here a connection is trusted only after both ends prove they know the
job's secret:

1. server -> client: 8-byte magic, 32-byte random nonce ``ns``
2. client -> server: nonce ``nc``, hello length, JSON hello (name, rank), and
   ``HMAC-SHA256(secret, "client" | ns | nc | hello)``
3. server -> client: ``"OK"`` and ``HMAC-SHA256(secret, "server" | nc | ns)``

Every field before the MAC check has a fixed or bounded size, and nothing is unpickled
(or even JSON-parsed) before the MAC matches. The secret comes from ``secret_file``,
``RALLYPOINT_RPC_SECRET`` (``rallypoint run`` generates one per job), or, only when
explicitly allowed, from the rendezvous store (then whoever can read the store can join).
Traffic is authenticated at connection set-up, not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import time
from typing import Any

from rallypoint._core.envvars import RPC_ALLOW_STORE_SECRET, RPC_SECRET
from rallypoint.rpc._errors import RpcAuthenticationError

logger = logging.getLogger("rallypoint.rpc")

_MAGIC = b"RPRPC1\x00\x00"
_NONCE = 32
_MAC = 32
_MAX_HELLO = 4096
_LEN = struct.Struct("<I")
_STORE_SECRET_KEY = "rpc_store_secret"


def resolve_secret(options: Any, store: Any) -> bytes:
    """The job's RPC secret, from the options' file, the environment, or (if allowed) the store."""
    secret_file = getattr(options, "secret_file", None)
    if secret_file is not None:
        with open(secret_file, "rb") as fh:
            data = fh.read().strip()
        if not data:
            raise ValueError(
                f"secret_file {os.fspath(secret_file)!r} is empty; write a secret into it"
            )
        return data
    env = os.environ.get(RPC_SECRET, "")
    if env:
        return env.encode()
    if _store_secret_allowed(options):
        candidate = secrets.token_hex(32)
        value = store.compare_set(_STORE_SECRET_KEY, "", candidate)
        text = value.decode() if isinstance(value, bytes) else str(value)
        if not text:
            store.compare_set(_STORE_SECRET_KEY, "", candidate)
            text = store.get(_STORE_SECRET_KEY).decode()
        logger.warning(
            "rallypoint.rpc: using an RPC secret shared through the rendezvous store; "
            "anyone who can read the store can join this job. Set %s for a real secret.",
            RPC_SECRET,
        )
        return text.encode()
    raise _no_secret()


def require_secret_source(options: Any) -> None:
    """Raise at once when :func:`resolve_secret` would find no secret: before the store
    exists, so every worker of a job without one fails now (else the store's host fails
    after starting the store and the others wait for it until their timeout)."""
    has_file = getattr(options, "secret_file", None) is not None
    if not (has_file or os.environ.get(RPC_SECRET, "") or _store_secret_allowed(options)):
        raise _no_secret()


def _store_secret_allowed(options: Any) -> bool:
    return bool(getattr(options, "allow_store_secret", False)) or os.environ.get(
        RPC_ALLOW_STORE_SECRET, ""
    ) not in ("", "0", "false", "False")


def _no_secret() -> RpcAuthenticationError:
    return RpcAuthenticationError(
        f"no RPC secret: set {RPC_SECRET} to the same random value in every worker "
        "(`rallypoint run` does this for you), pass secret_file= in "
        "RallypointRpcBackendOptions, or allow a store-distributed secret with "
        f"allow_store_secret=True / {RPC_ALLOW_STORE_SECRET}=1"
    )


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them before ``deadline`` (a slow sender cannot stretch it)."""
    chunks = bytearray()
    while len(chunks) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the peer did not finish authenticating in time")
        sock.settimeout(remaining)
        data = sock.recv(n - len(chunks))
        if not data:
            raise RpcAuthenticationError("peer closed the connection during authentication")
        chunks += data
    return bytes(chunks)


class ServerHandshake:
    """The server's side of the challenge as a state machine fed bytes as they arrive.

    It never blocks, so one thread can run many handshakes (see ``_acceptor``): send
    :attr:`greeting`, then read at most :meth:`wanted` bytes at a time and :meth:`feed`
    them until it returns ``(reply, hello)``; send ``reply`` and the peer is trusted.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._server_nonce = secrets.token_bytes(_NONCE)
        self.greeting = _MAGIC + self._server_nonce
        self._buf = bytearray()
        self._total = _NONCE + _LEN.size  # grows once the hello length is known

    def wanted(self) -> int:
        """How many bytes the next step needs (never more than the handshake has left)."""
        return self._total - len(self._buf)

    def feed(self, data: bytes) -> tuple[bytes, dict[str, Any]] | None:
        """Take bytes; ``(reply, hello)`` once the client proved it knows the secret."""
        if len(data) > self.wanted():
            raise RpcAuthenticationError("client sent more than the handshake")
        self._buf += data
        head = _NONCE + _LEN.size
        if len(self._buf) == head and self._total == head:
            (hello_len,) = _LEN.unpack_from(self._buf, _NONCE)
            if hello_len > _MAX_HELLO:
                raise RpcAuthenticationError(
                    f"hello of {hello_len} bytes is larger than {_MAX_HELLO}"
                )
            self._total = head + hello_len + _MAC
        if len(self._buf) < self._total:
            return None
        client_nonce = bytes(self._buf[:_NONCE])
        hello = bytes(self._buf[head : self._total - _MAC])
        mac = bytes(self._buf[self._total - _MAC :])
        expected = _mac(self._secret, b"client", self._server_nonce, client_nonce, hello)
        if not hmac.compare_digest(mac, expected):
            raise RpcAuthenticationError("client failed the HMAC challenge (wrong RPC secret)")
        reply = b"OK" + _mac(self._secret, b"server", client_nonce, self._server_nonce)
        try:
            info = json.loads(hello)
        except ValueError as exc:
            raise RpcAuthenticationError("authenticated client sent a malformed hello") from exc
        if not isinstance(info, dict):
            raise RpcAuthenticationError("authenticated client sent a malformed hello")
        return reply, info


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> dict[str, Any]:
    """Challenge a connection (blocking); the client's hello once it authenticated.

    ``timeout`` bounds the whole handshake, not each read.
    """
    deadline = time.monotonic() + timeout
    handshake = ServerHandshake(secret)
    sock.settimeout(timeout)
    sock.sendall(handshake.greeting)
    while True:
        done = handshake.feed(_recv_exact(sock, handshake.wanted(), deadline))
        if done is not None:
            reply, info = done
            sock.sendall(reply)
            sock.settimeout(None)
            return info


def client_handshake(
    sock: socket.socket, secret: bytes, hello: dict[str, Any], timeout: float
) -> None:
    """Answer the server's challenge and check that the server knows the secret too.

    ``timeout`` bounds the whole handshake, not each read.
    """
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    first = _recv_exact(sock, len(_MAGIC) + _NONCE, deadline)
    if first[: len(_MAGIC)] != _MAGIC:
        raise RpcAuthenticationError("the peer is not a rallypoint RPC server")
    server_nonce = first[len(_MAGIC) :]
    client_nonce = secrets.token_bytes(_NONCE)
    body = json.dumps(hello).encode()
    mac = _mac(secret, b"client", server_nonce, client_nonce, body)
    sock.sendall(client_nonce + _LEN.pack(len(body)) + body + mac)
    try:
        answer = _recv_exact(sock, 2 + _MAC, deadline)
    except RpcAuthenticationError:
        raise RpcAuthenticationError(
            "the server closed the connection during authentication: the RPC secrets differ"
        ) from None
    expected = _mac(secret, b"server", client_nonce, server_nonce)
    if answer[:2] != b"OK" or not hmac.compare_digest(answer[2:], expected):
        raise RpcAuthenticationError("the server failed the HMAC challenge (wrong RPC secret)")
    sock.settimeout(None)
