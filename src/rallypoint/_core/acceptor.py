"""Listening sockets and the handshakes of connections nobody has authenticated yet.

The RPC port and the snapshot servers' peer port both accept here. Until a connection
proves that it knows the job's secret (:mod:`._core.handshake`) it costs its server as
little as possible, so that unauthenticated peers cannot take the server down or lock out
a legitimate peer: one thread and a selector run the listeners and every pending
handshake, each handshake has one deadline, pending handshakes are capped in all and per
peer address, and the listeners pause instead of spinning when descriptors run out
(:class:`Acceptor` says how). Rejections are logged through :class:`RejectionLog`. An
authenticated connection is handed to ``on_authenticated(sock, uds, hello)`` as a
blocking socket.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import selectors
import socket
import threading
import time
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from rallypoint._core.handshake import HandshakeError, ServerHandshake
from rallypoint._core.peercred import same_user

__all__ = ["MAX_PENDING", "Acceptor", "RejectionLog", "max_pending"]

MAX_PENDING = 128
GRACE = 1.0
"""Seconds a pending handshake keeps its place unless it is the newest (a quarter of the
handshake deadline when that is shorter)."""
_ACCEPT_BURST = 64
_PAUSE_MIN = 0.01
_PAUSE_MAX = 0.2
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

OnAuthenticated = Callable[[socket.socket, bool, dict[str, Any]], None]
Log = Callable[[int, str], None]
"""``log(level, text)``, ``level`` as in :mod:`logging`."""
Blocked = Callable[..., AbstractContextManager[Any]]


def _no_report(*fds: int) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def max_pending() -> int:
    """Most handshakes pending at once: :data:`MAX_PENDING`, or an eighth of the fd limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(8, min(MAX_PENDING, soft // 8))


class RejectionLog:
    """Lines about rejected connections that an attacker cannot turn into a flood.

    Up to ``burst`` lines as they come, then one line per ``every`` seconds at most (a
    token bucket); a rejection with no token left is counted, and the next line says how
    many were not shown. :meth:`due` says when a line that only reports the count is
    owed, :meth:`flush` writes it (``force``: now, when the acceptor closes).
    """

    def __init__(self, log: Log, *, burst: int = 5, every: float = 10.0) -> None:
        self._log = log
        self._burst = burst
        self._every = every
        self._tokens = float(burst)
        self._at = time.monotonic()
        self.unreported = 0
        self._last = ""

    def _refill(self, now: float) -> None:
        self._tokens = min(self._burst, self._tokens + (now - self._at) / self._every)
        self._at = now

    def reject(self, where: str, reason: str) -> None:
        now = time.monotonic()
        self._refill(now)
        self._last = f"{where}: {reason}"
        if self._tokens < 1:
            self.unreported += 1
            return
        self._tokens -= 1
        more = self._more()
        self._log(logging.WARNING, f"rejected a connection from {self._last}{more}")

    def _more(self) -> str:
        count, self.unreported = self.unreported, 0
        return f" ({count} more rejected since the last message)" if count else ""

    def due(self) -> float | None:
        """When :meth:`flush` has a count to report (``time.monotonic()``), or ``None``."""
        if not self.unreported:
            return None
        return self._at + max(0.0, 1 - self._tokens) * self._every

    def flush(self, *, force: bool = False) -> None:
        self._refill(time.monotonic())
        if not self.unreported or (self._tokens < 1 and not force):
            return
        self._tokens = max(0.0, self._tokens - 1)
        count, self.unreported = self.unreported, 0
        self._log(
            logging.WARNING, f"rejected {count} more connections (the last from {self._last})"
        )


@dataclass(slots=True, eq=False)
class _Pending:
    sock: socket.socket
    uds: bool
    where: str
    peer: str
    """The peer's address without its port: the key of the per-address cap."""
    since: float
    deadline: float
    handshake: ServerHandshake


class Acceptor:
    """Listeners plus the pending handshakes, on one thread (started here).

    ``listeners``: bound, listening sockets (TCP, or Unix: ``uds`` for its connections);
    ``handshake()``: a fresh server side of the challenge for each connection; ``log``:
    where rejections and trouble are reported (:class:`RejectionLog` throttles them);
    ``blocked``: a context manager entered around each wait, with the fds waited on.

    Sockets are non-blocking and a :class:`~._core.handshake.ServerHandshake` is fed bytes as
    they arrive, so idle connections cost sockets, not threads. Each handshake has one
    deadline for the whole exchange (a slowloris is dropped when it passes). At most
    :func:`max_pending` handshakes wait at a time, at most half of them from one peer
    address. A new connection beyond its address's share drops that address's oldest
    pending handshake once that one has had :data:`GRACE` to answer, and before that the
    newest one instead; one beyond the total does the same among all. So a flood exhausts
    no file descriptors, a new peer always gets a place, and strangers that reconnect
    whenever they are dropped cannot push out a peer beside them before its grace: their
    churn pushes out only each other (dropping the oldest alone, the churn reached the
    peer within milliseconds). A Unix connection whose peer runs as
    another uid (:mod:`._core.peercred`) is dropped before the greeting. When ``accept()``
    fails for want of resources (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) the
    listeners pause, from ``_PAUSE_MIN`` doubling up to ``_PAUSE_MAX``, while connections
    wait in the kernel's backlog.
    """

    def __init__(
        self,
        listeners: Sequence[socket.socket],
        handshake: Callable[[], ServerHandshake],
        on_authenticated: OnAuthenticated,
        *,
        deadline: float,
        log: Log,
        name: str,
        blocked: Blocked = _no_report,
    ) -> None:
        self._listeners = [(s, s.family == socket.AF_UNIX) for s in listeners]
        for listener in listeners:
            listener.setblocking(False)
        self._handshake = handshake
        self._on_authenticated = on_authenticated
        self._deadline = deadline
        self._log = log
        self._blocked = blocked
        self.rejections = RejectionLog(log)
        self._cap = max_pending()
        self._grace = min(GRACE, deadline / 4)
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._per_peer: Counter[str] = Counter()
        self._paused_until = 0.0
        self._pause = _PAUSE_MIN
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._listen(True)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def peer_cap(self) -> int:
        """Most handshakes pending from one peer address."""
        return max(2, self._cap // 2)

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                with self._blocked(*(key.fd for key in self._sel.get_map().values())):
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
                self.rejections.flush()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending, None)
            self._sel.close()
            self.rejections.flush(force=True)

    def _handle(self, key: selectors.SelectorKey) -> None:
        """One ready socket. Events that an earlier event of the same batch made stale are
        skipped: a handshake that an accept beyond the cap dropped (its socket is closed),
        a listener after the other one ran out of descriptors (both are paused). Nothing
        one connection does may end the loop: the server could accept no peer again."""
        pending = key.data
        try:
            if not isinstance(pending, _Pending):
                if not self._paused_until:  # else: the listeners paused earlier in the batch
                    self._accept(key.fileobj, pending)  # type: ignore[arg-type]
            elif self._pending.get(pending.sock) is pending:
                self._advance(pending)
        except Exception:  # pragma: no cover - bug guard: keep accepting peers
            self._log(
                logging.ERROR, f"the acceptor failed on a connection:\n{traceback.format_exc()}"
            )
            if isinstance(pending, _Pending) and pending.sock in self._pending:
                self._drop(pending, None)

    def _timeout(self) -> float | None:
        """Until the next handshake deadline, the end of a pause or a due log line."""
        ends = []
        if self._pending:  # oldest first, so the first deadline is the earliest
            ends.append(next(iter(self._pending.values())).deadline)
        if self._paused_until:
            ends.append(self._paused_until)
        due = self.rejections.due()
        if due is not None:
            ends.append(due)
        return max(min(ends) - time.monotonic(), 0.0) if ends else None

    def _listen(self, on: bool) -> None:
        for listener, uds in self._listeners:
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
            if uds:
                ours, uid = same_user(sock)
                if not ours:
                    sock.close()
                    self.rejections.reject(f"a local process (uid {uid})", "not this job's user")
                    continue
                self._start(sock, True, "a local process", "local")
            else:
                self._start(sock, False, f"{addr[0]}:{addr[1]}", str(addr[0]))

    def _out_of_resources(self, exc: OSError) -> None:
        """Stop accepting for a while: the listener stays readable until fds free up."""
        if self._pause == _PAUSE_MIN:
            self._log(logging.WARNING, f"cannot accept connections ({exc}); pausing the listener")
        self._listen(False)
        self._paused_until = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, _PAUSE_MAX)

    def _start(self, sock: socket.socket, uds: bool, where: str, peer: str) -> None:
        self._make_room(peer)
        if not uds:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        handshake = self._handshake()
        try:
            sent = sock.send(handshake.greeting)  # 40 bytes into an empty socket buffer
        except OSError:
            sent = 0
        if sent != len(handshake.greeting):
            sock.close()
            return
        now = time.monotonic()
        pending = _Pending(sock, uds, where, peer, now, now + self._deadline, handshake)
        self._pending[sock] = pending
        self._per_peer[peer] += 1
        self._sel.register(sock, selectors.EVENT_READ, pending)

    def _make_room(self, peer: str) -> None:
        """Below both caps: drop the oldest handshake in the way, or the newest while the
        oldest is within its grace."""
        if self._per_peer[peer] >= self.peer_cap:
            mine = [p for p in self._pending.values() if p.peer == peer]  # oldest first
            self._push_out(mine[0], mine[-1], f"{self.peer_cap} connections from it")
        if len(self._pending) >= self._cap:
            every = list(self._pending.values())
            self._push_out(every[0], every[-1], f"{self._cap} connections")

    def _push_out(self, oldest: _Pending, newest: _Pending, what: str) -> None:
        if time.monotonic() - oldest.since >= self._grace:
            self._drop(oldest, f"{what} were authenticating; it was the oldest")
        else:
            self._drop(newest, f"{what} were authenticating; it was the newest")

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
        except HandshakeError as exc:
            if exc.reply:  # small: the socket's buffer takes it whole, or it is lost
                with contextlib.suppress(OSError):
                    pending.sock.send(exc.reply)
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
            self.rejections.reject(pending.where, str(exc))
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
        if self._pending.pop(pending.sock, None) is not None:
            self._per_peer[pending.peer] -= 1
            if not self._per_peer[pending.peer]:
                del self._per_peer[pending.peer]
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(pending.sock)

    def _drop(self, pending: _Pending, reason: str | None) -> None:
        self._forget(pending)
        pending.sock.close()
        if reason is not None:
            self.rejections.reject(pending.where, reason)

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread and close the listeners (and every pending handshake)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5)
        for listener, _ in self._listeners:
            listener.close()
        for sock in (self._wake_r, self._wake_w):
            sock.close()
