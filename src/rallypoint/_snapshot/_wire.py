"""Messages of the snapshot servers: JSON headers, raw snapshot bytes, never pickle.

- Worker <-> its node's server: a Unix ``SOCK_SEQPACKET`` socket, one JSON object per
  packet, a slot's memfd passed with ``SCM_RIGHTS`` where a reply carries one.
- Server <-> server (TCP, after the HMAC handshake of ``_auth``): a 4-byte length and a
  JSON object per header; a snapshot's bytes follow a header that gives their length
  (read with :func:`~rallypoint._core.handshake.recv_exact`/``recv_into``, under the
  socket's timeout).

Every header field is checked for its type (:func:`field`); anything malformed raises
:class:`ProtocolError` and the server drops that connection and keeps serving.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any, TypeVar

from rallypoint._core.handshake import recv_exact, recv_into

__all__ = [
    "MAX_HEADER",
    "ProtocolError",
    "field",
    "recv_exact",
    "recv_frame",
    "recv_into",
    "recv_local",
    "send_frame",
    "send_from_fd",
    "send_local",
]

MAX_HEADER = 1 << 16
_LEN = struct.Struct("<I")
_T = TypeVar("_T")


class ProtocolError(Exception):
    """A peer sent something that is not a snapshot message."""


def _decode(data: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"malformed header: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a header must be a JSON object")
    return msg


def field(msg: dict[str, Any], name: str, kind: type[_T]) -> _T:
    """``msg[name]`` if it has type ``kind`` (``bool`` is not an ``int``)."""
    value = msg.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, got {value!r}")
    return value


# ---------------------------------------------------------------- local (Unix, seqpacket)
def send_local(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_local(sock: socket.socket, maxfds: int = 1) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; ``None`` when the peer closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_HEADER, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        return _decode(data), list(fds)
    except ProtocolError:
        for fd in fds:
            os.close(fd)
        raise


# ---------------------------------------------------------------- peers (TCP)
def send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ProtocolError(f"header of {n} bytes is larger than {MAX_HEADER}")
    return _decode(recv_exact(sock, n))


def send_from_fd(sock: socket.socket, fd: int, count: int) -> None:
    """Send the first ``count`` bytes of file ``fd`` (a slot's memfd) with ``sendfile``
    (no copy through Python), under the socket's timeout."""
    with open(fd, "rb", closefd=False) as file:
        sent = sock.sendfile(file, 0, count)
    if sent != count:
        raise ConnectionError(f"sent {sent} of {count} bytes")
