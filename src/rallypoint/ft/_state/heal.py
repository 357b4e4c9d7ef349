"""Healing from a live peer: a group's state streamed over an authenticated connection.

Each rank runs a :class:`HealServer`; while its group is a heal's source (between a quorum
and the next commit) it serves its state for that step to the healing group's rank of the
same group rank (:func:`fetch_state`), after a mutual HMAC challenge over the job's secret
(:mod:`rallypoint._core.handshake`). Nothing is unpickled: typed JSON, then raw tensor
bytes (``encoding``). A :class:`HealServer` is ``Manager``'s default ``CheckpointTransport``
(``metadata()`` is its address). Errors: :class:`HealError`, with the source's address.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from rallypoint._core.fatal import FatalError
from rallypoint._core.handshake import (
    HandshakeError,
    Scheme,
    client_handshake,
    recv_exact,
    recv_into,
    server_handshake,
)
from rallypoint.ft._state.encoding import (
    MAX_HEADER,
    HealError,
    decode_skeleton,
    empty_tensors,
    encode_skeleton,
    header_bytes,
    pack,
    parse_header,
    raw_bytes,
    unpack,
)
from rallypoint.ft.checkpointing.transport import CheckpointTransport

__all__ = [
    "HealError",
    "HealServer",
    "IncompatibleStateError",
    "decode_skeleton",
    "encode_skeleton",
    "fetch_state",
    "mismatch",
]

SCHEME = Scheme(
    what="heal",
    magic=b"RPHEAL01",
    client_label=b"rallypoint-heal-client",
    server_label=b"rallypoint-heal-server",
    hello=True,
)
_LEN = struct.Struct("<Q")
_CHUNK = 8 << 20
MAX_CONNECTIONS = 64
"""Connections a heal server serves at once (a heal takes one per healing group)."""
HANDSHAKE_TIMEOUT = 5.0
"""Seconds a connection has to authenticate before it is dropped."""


class IncompatibleStateError(HealError, FatalError):
    """A peer's state has other tensors than this group's (another model): the group's job
    ends, before it sends a byte of a collective that would not match."""


def mismatch(mine: Any, theirs: Any, path: str = "state") -> str:
    """Where two states' tensors differ, at the same place in both (``""``: they fit; a
    place only one has, an optimizer's moments before its first step say, is no misfit)."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return (
                f"{path} is {theirs.dtype} {tuple(theirs.shape)} where this group's is "
                f"{mine.dtype} {tuple(mine.shape)}"
            )
        return ""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        pairs = [(k, mine[k], theirs[k], f"{path}[{k!r}]") for k in mine if k in theirs]
    elif isinstance(mine, list | tuple) and isinstance(theirs, list | tuple):
        pairs = [
            (i, a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
        ]
    else:
        return ""
    for _, a, b, where in pairs:
        found = mismatch(a, b, where)
        if found:
            return found
    return ""


# ---------------------------------------------------------------------- the server
class HealServer(CheckpointTransport[Any]):
    """Serves this rank's state for one step at a time, to authenticated peers."""

    def __init__(self, secret: bytes, host: str = "", timeout: float = 60.0, port: int = 0) -> None:
        self.secret = secret
        self.timeout = timeout
        self._lock = threading.Condition()
        self._step: int | None = None
        self._state: Any = None
        self._past = -1
        """Steps below this are never served again: the state moved on (``passed``)."""
        self._serving = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept, name="rallypoint-ft-heal", daemon=True).start()

    def allow(self, step: int, state: Any) -> None:
        """Serve ``state`` (a callable, read once per request, or the object) for ``step``."""
        with self._lock:
            self._step, self._state = step, state
            self._past = min(self._past, step)  # (a state loaded back to an earlier step)
            self._lock.notify_all()

    def disallow(self) -> None:
        """Stop serving; waits for the transfers under way (the state may change after)."""
        with self._lock:
            self._step, self._state = None, None
            while self._serving:
                self._lock.wait()

    def passed(self, step: int) -> None:
        """The state is at ``step`` now: a healer still asking for an older one is
        told at once that it is not here (it asks the lighthouse again), not kept waiting."""
        with self._lock:
            self._past = max(self._past, step)
            self._lock.notify_all()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    # ------------------------------------------------------------ CheckpointTransport
    advertised = "127.0.0.1"
    """The host peers reach this server at (the manager sets it from its ``hostname``)."""

    def metadata(self) -> str:
        return f"{self.advertised}:{self.port}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        self.allow(step, state_dict)

    def disallow_checkpoint(self) -> None:
        self.disallow()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return fetch_state(metadata, self.secret, step, timeout.total_seconds())[0]

    def shutdown(self, wait: bool = True) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # more connections than any heal needs: a flood, dropped
                continue
            threading.Thread(target=self._serve_slot, args=(conn,), daemon=True).start()

    def _serve_slot(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            # a stranger that does not authenticate within HANDSHAKE_TIMEOUT is dropped
            deadline = time.monotonic() + min(self.timeout, HANDSHAKE_TIMEOUT)
            try:
                hello = server_handshake(conn, self.secret, SCHEME, deadline)
            except (HandshakeError, OSError, TimeoutError):
                return  # not of the job, or gone: dropped
            deadline = time.monotonic() + self.timeout
            try:
                step = int(hello.get("step", -1))
            except (TypeError, ValueError):
                return
            state = self._wait_for(step, deadline)
            if state is None:
                _send_header(conn, {"error": f"no state for step {step} here"})
                return
            try:
                self._send_state(conn, state() if callable(state) else state)
            except (OSError, HealError) as exc:
                with contextlib.suppress(OSError):
                    _send_header(conn, {"error": str(exc)})
            finally:
                with self._lock:
                    self._serving -= 1
                    self._lock.notify_all()

    def _wait_for(self, step: int, deadline: float) -> Any:
        with self._lock:
            while self._step != step:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or step < self._past:
                    return None
                self._lock.wait(min(left, 0.5))
            self._serving += 1
            return self._state

    @staticmethod
    def _send_state(conn: socket.socket, state: Any) -> None:
        header, flat = pack(state)
        _send_header(conn, header)
        for t in flat:
            view = raw_bytes(t)
            for start in range(0, len(view), _CHUNK):
                conn.sendall(view[start : start + _CHUNK])


def _send_header(conn: socket.socket, header: dict[str, Any]) -> None:
    body = header_bytes(header)
    conn.sendall(_LEN.pack(len(body)) + body)


# ---------------------------------------------------------------------- the client
def fetch_state(address: str, secret: bytes, step: int, timeout: float) -> tuple[Any, int]:
    """The state ``address`` serves for ``step``, and how many tensor bytes came."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            client_handshake(sock, secret, SCHEME, deadline, hello={"step": step})
            (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
            if length > MAX_HEADER:
                raise HealError(f"{address}: a heal header of {length} bytes")
            header = parse_header(recv_exact(sock, length, deadline))
            if "error" in header:
                raise HealError(f"{address}: {header['error']}")
            tensors = empty_tensors(header)
            total = 0
            for t in tensors:
                if t.numel():
                    recv_into(sock, raw_bytes(t), deadline)
                total += t.numel() * t.element_size()
            return unpack(header, tensors), total
    except HandshakeError as exc:
        raise HealError(f"{address}: {exc}") from exc
    except (OSError, TimeoutError, ValueError, KeyError) as exc:
        raise HealError(f"{address}: the heal failed: {type(exc).__name__}: {exc}") from exc
