"""Per-job secret and the HMAC challenge every connection answers before it is trusted.

Anyone who can connect to a worker could otherwise make it unpickle arbitrary bytes,
which is arbitrary code execution (torch's RPC has exactly this hole, CVE-2024-5480).
Here a connection is trusted only after both ends prove they know the job's secret, in
:mod:`rallypoint._core.handshake`'s exchange with the RPC labels; the client's hello
(name, rank) is covered by its MAC, and nothing is unpickled or even JSON-parsed before
the MAC matches. The secret comes from ``secret_file``, ``RALLYPOINT_RPC_SECRET``
(``rallypoint run`` makes one per job) or, only when explicitly allowed, the rendezvous
store (:func:`resolve_secret`). Traffic is authenticated at set-up, not encrypted.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any

from rallypoint._core import handshake as _handshake
from rallypoint._core.envvars import RPC_ALLOW_STORE_SECRET, RPC_SECRET
from rallypoint._core.handshake import HandshakeError, Scheme
from rallypoint.rpc._errors import RpcAuthenticationError

if TYPE_CHECKING:
    from rallypoint._core.store import Store

logger = logging.getLogger("rallypoint.rpc")

_MAGIC = b"RPRPC1\x00\x00"
_STORE_SECRET_KEY = "rpc_store_secret"


def resolve_secret(options: Any, store: Store) -> bytes:
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


SCHEME = Scheme(what="RPC", magic=_MAGIC, client_label=b"client", server_label=b"server",
                hello=True, accept=b"OK")  # fmt: skip
"""The RPC port's handshake (:mod:`rallypoint._core.handshake` runs it)."""


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> dict[str, Any]:
    """Challenge a connection (blocking); the client's hello once it authenticated.

    ``timeout`` bounds the whole handshake, not each read.
    """
    try:
        info = _handshake.server_handshake(sock, secret, SCHEME, time.monotonic() + timeout)
    except HandshakeError as exc:
        raise RpcAuthenticationError(str(exc)) from None
    sock.settimeout(None)
    return info


def client_handshake(
    sock: socket.socket, secret: bytes, hello: dict[str, Any], timeout: float
) -> None:
    """Answer the server's challenge and check that the server knows the secret too.

    ``timeout`` bounds the whole handshake, not each read.
    """
    try:
        _handshake.client_handshake(sock, secret, SCHEME, time.monotonic() + timeout, hello)
    except HandshakeError as exc:
        raise RpcAuthenticationError(str(exc)) from None
    sock.settimeout(None)
