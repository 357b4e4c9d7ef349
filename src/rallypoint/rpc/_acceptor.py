"""The listening sockets and the handshakes of connections nobody has authenticated yet.

Until a connection proves that it knows the job's secret it costs the worker as little as
possible, so that unauthenticated peers cannot take it down:

- One thread runs the listeners *and* every pending handshake, with non-blocking sockets
  and a selector (:class:`~rallypoint.rpc._auth.ServerHandshake` is fed bytes as they
  arrive): 200 idle connections cost 200 sockets, not 200 threads.
- Each handshake has one deadline for the whole exchange (a slowloris that sends a byte
  now and then is dropped when it passes), and at most :func:`max_pending` handshakes
  wait at a time: a new connection beyond that drops the oldest pending one, so a flood
  neither exhausts file descriptors nor locks out a legitimate peer for long.
- When ``accept()`` fails for want of resources (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
  ``ENOMEM``) the listeners pause, 10 ms at first and up to 200 ms, instead of spinning
  on a socket that stays readable; connections wait in the kernel's backlog meanwhile
  and are accepted once descriptors free up.

An authenticated connection is handed to ``on_authenticated(sock, uds, hello)`` (a
blocking socket from then on); a rejected one is logged and closed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rallypoint.rpc._auth import ServerHandshake
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._spin import WAITS

logger = logging.getLogger("rallypoint.rpc")

MAX_PENDING = 128
_ACCEPT_BURST = 64
_PAUSE_MIN = 0.01
_PAUSE_MAX = 0.2
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

OnAuthenticated = Callable[[socket.socket, bool, dict[str, Any]], None]


def max_pending() -> int:
    """Most handshakes pending at once: :data:`MAX_PENDING`, or an eighth of the fd limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(8, min(MAX_PENDING, soft // 8))


@dataclass(slots=True, eq=False)
class _Pending:
    sock: socket.socket
    uds: bool
    where: str
    deadline: float
    handshake: ServerHandshake


class Acceptor:
    """TCP and abstract-Unix listeners plus the pending handshakes, on one thread."""

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
        for listener in (self.tcp, self.uds):
            listener.setblocking(False)
        self._secret = secret
        self._on_authenticated = on_authenticated
        self._deadline = deadline
        self._cap = max_pending()
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._paused_until = 0.0
        self._pause = _PAUSE_MIN
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._listen(True)
        self._thread = threading.Thread(target=self._loop, name="rpc-accept", daemon=True)
        self._thread.start()

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                with WAITS.blocked(*(key.fd for key in self._sel.get_map().values())):
                    events = self._sel.select(self._timeout())
                for key, _ in events:
                    if key.data is None:
                        return
                    self._handle(key)
                now = time.monotonic()
                self._expire(now)
                if self._paused_until and now >= self._paused_until:
                    self._paused_until = 0.0
                    self._listen(True)
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending, None)
            self._sel.close()

    def _handle(self, key: selectors.SelectorKey) -> None:
        """One ready socket. Events that an earlier event of the same batch made stale are
        skipped: a handshake that an accept beyond the cap dropped (its socket is closed),
        a listener after the other one ran out of descriptors (both are paused). Nothing
        one connection does may end the loop: the worker could accept no peer again."""
        pending = key.data
        try:
            if not isinstance(pending, _Pending):
                if not self._paused_until:  # else: the listeners paused earlier in the batch
                    self._accept(key.fileobj, pending)  # type: ignore[arg-type]
            elif self._pending.get(pending.sock) is pending:
                self._advance(pending)
        except Exception:  # pragma: no cover - bug guard: keep accepting peers
            logger.exception("rallypoint.rpc: the acceptor failed on a connection")
            if isinstance(pending, _Pending) and pending.sock in self._pending:
                self._drop(pending, None)

    def _timeout(self) -> float | None:
        """Until the next handshake deadline or the end of a pause (``None``: none)."""
        ends = []
        if self._pending:  # oldest first, so the first deadline is the earliest
            ends.append(next(iter(self._pending.values())).deadline)
        if self._paused_until:
            ends.append(self._paused_until)
        return max(min(ends) - time.monotonic(), 0.0) if ends else None

    def _listen(self, on: bool) -> None:
        for listener, uds in ((self.tcp, False), (self.uds, True)):
            if on:
                self._sel.register(listener, selectors.EVENT_READ, uds)
            else:
                self._sel.unregister(listener)

    # ---- accepting ---------------------------------------------------------------------
    def _accept(self, listener: socket.socket, uds: bool) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._out_of_resources(exc)
                return  # e.g. ECONNABORTED: that one is gone, the next select retries
            self._pause = _PAUSE_MIN
            self._start(sock, uds, "a local process" if uds else f"{addr[0]}:{addr[1]}")

    def _out_of_resources(self, exc: OSError) -> None:
        """Stop accepting for a while: the listener stays readable until fds free up."""
        if self._pause == _PAUSE_MIN:
            logger.warning(
                "rallypoint.rpc: cannot accept connections (%s); pausing the listener", exc
            )
        self._listen(False)
        self._paused_until = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, _PAUSE_MAX)

    def _start(self, sock: socket.socket, uds: bool, where: str) -> None:
        if not uds:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        handshake = ServerHandshake(self._secret)
        try:
            sent = sock.send(handshake.greeting)  # 40 bytes into an empty socket buffer
        except OSError:
            sent = 0
        if sent != len(handshake.greeting):
            sock.close()
            return
        pending = _Pending(sock, uds, where, time.monotonic() + self._deadline, handshake)
        self._pending[sock] = pending
        self._sel.register(sock, selectors.EVENT_READ, pending)
        while len(self._pending) > self._cap:
            oldest = next(iter(self._pending.values()))
            self._drop(oldest, f"more than {self._cap} connections were authenticating")

    # ---- handshakes --------------------------------------------------------------------
    def _advance(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(pending.handshake.wanted())
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(pending, str(exc))
            return
        if not data:
            self._drop(pending, "peer closed the connection during authentication")
            return
        try:
            done = pending.handshake.feed(data)
        except RpcError as exc:
            self._drop(pending, str(exc))
            return
        if done is not None:
            self._admit(pending, *done)

    def _admit(self, pending: _Pending, reply: bytes, hello: dict[str, Any]) -> None:
        self._forget(pending)
        sock = pending.sock
        try:
            sock.settimeout(max(pending.deadline - time.monotonic(), 0.1))
            sock.sendall(reply)
            sock.settimeout(None)
        except OSError as exc:
            self._log_rejection(pending, str(exc))
            sock.close()
            return
        self._on_authenticated(sock, pending.uds, hello)

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._drop(oldest, f"did not authenticate within {self._deadline:.1f} s")

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(pending.sock)

    def _drop(self, pending: _Pending, reason: str | None) -> None:
        self._forget(pending)
        pending.sock.close()
        if reason is not None:
            self._log_rejection(pending, reason)

    def _log_rejection(self, pending: _Pending, reason: str) -> None:
        logger.warning("rallypoint.rpc: rejected a connection from %s: %s", pending.where, reason)

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5)
        for sock in (self.tcp, self.uds, self._wake_r, self._wake_w):
            sock.close()
