"""The node's snapshot server: holds its workers' snapshots and the replicas of a peer's.

Forked by the warm process of ``rallypoint run``, it outlives every worker of the node and
dies with the node's launcher. It keeps snapshots in anonymous shared memory
(``_records``) and only moves bytes: it never unpickles anything. It listens twice: on a
Unix socket for the node's own workers (a directory only the job's user can enter, and
the peer's uid checked), which write and restore snapshots through :class:`LocalSession`;
and on TCP for the other nodes' servers, opened once a worker has told it the job's secret
and the address to publish. A TCP peer must pass the HMAC challenge (``_auth``) in
:mod:`rallypoint._core.acceptor` before a header is read, and at most :data:`MAX_PEERS`
authenticated peers are served at once.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from rallypoint._core.acceptor import GRACE, Acceptor
from rallypoint._core.handshake import ServerHandshake
from rallypoint._core.peercred import same_user
from rallypoint._core.throttle import Throttle
from rallypoint._snapshot._auth import SCHEME, AuthError, client_handshake
from rallypoint._snapshot._records import Key, Records, Slot
from rallypoint._snapshot._wire import (
    ProtocolError,
    field,
    recv_frame,
    recv_into,
    recv_local,
    send_frame,
    send_from_fd,
    send_local,
)

__all__ = ["HANDSHAKE_SECONDS", "MAX_ADDRESSES", "MAX_PEERS", "serve"]

HANDSHAKE_SECONDS = 5.0
CONNECT_SECONDS = HANDSHAKE_SECONDS + 1
"""A client's limit for connect and handshake."""
MAX_PEERS = 256
MAX_ADDRESSES = 8
PEER_TIMEOUT = 30.0
"""Seconds without progress before a peer transfer gives up (a cut link)."""
IDLE_SECONDS = 600.0
"""An authenticated peer connection with no request for this long is closed."""
_MAX_SNAPSHOT = 1 << 40
_PEER_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
"""How a worker that died with a request or an answer in flight shows on its connection."""
_debug = logging.getLogger("rallypoint.snapshot.server")


def serve(listener: socket.socket) -> NoReturn:
    """Serve until this process is killed (the warm process does, or dies: PDEATHSIG)."""
    Server(listener).run()
    os._exit(0)


class _Log:
    """At most one line per ``every`` seconds on stderr (an attacker cannot flood it)."""

    def __init__(self, every: float = 10.0) -> None:
        self._throttle = Throttle(every)

    def __call__(self, text: str) -> None:
        if self._throttle.ready():
            with contextlib.suppress(OSError):
                sys.stderr.write(f"rallypoint snapshot server: {text}\n")


def _stderr(level: int, text: str) -> None:
    """The acceptor's lines (it throttles rejections itself)."""
    with contextlib.suppress(OSError):
        sys.stderr.write(f"rallypoint snapshot server: {text}\n")


class Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.records = Records()
        self._secret: bytes | None = None
        self._lock = threading.Lock()
        self._acceptors: dict[str, tuple[Acceptor, int]] = {}  # host: (acceptor, port)
        self._peers = threading.BoundedSemaphore(MAX_PEERS)
        self.log = _Log()

    @property
    def secret(self) -> bytes | None:
        with self._lock:
            return self._secret

    def learn_secret(self, secret: bytes) -> bool:
        """The first worker's secret becomes the node's; later ones must be the same."""
        with self._lock:
            if self._secret is None:
                self._secret = secret
            return self._secret == secret

    def listen(self, host: str) -> int:
        """The port of the peer listener on ``host`` (an IP address), opened on first use."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ProtocolError(f"host must be an IP address, got {host!r}") from None
        with self._lock:
            secret = self._secret
            assert secret is not None, "listen() before a worker said hello"
            if host not in self._acceptors:
                if len(self._acceptors) >= MAX_ADDRESSES:
                    raise ProtocolError(f"listening on {MAX_ADDRESSES} addresses already")
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                tcp = socket.create_server((host, 0), family=family, backlog=128)
                acceptor = Acceptor(
                    [tcp],
                    lambda: ServerHandshake(secret, SCHEME),
                    self._admit,
                    deadline=HANDSHAKE_SECONDS,
                    log=_stderr,
                    name="snapshot-accept",
                )
                self._acceptors[host] = (acceptor, int(tcp.getsockname()[1]))
            return self._acceptors[host][1]

    def run(self) -> None:
        _accept_loop(self.listener, self._local, "snapshot-local")

    # ------------------------------------------------------------------ the node's workers
    def _local(self, conn: socket.socket) -> None:
        ours, uid = same_user(conn)
        if not ours:
            self.log(f"refused a local connection from uid {uid}")
            conn.close()
            return
        LocalSession(self, conn).serve()

    # ------------------------------------------------------------------ other nodes
    def _admit(self, conn: socket.socket, uds: bool, hello: dict[str, Any]) -> None:
        """An authenticated peer (on the acceptor's thread): served on a thread of its own."""
        if not self._peers.acquire(blocking=False):
            conn.close()
            return
        try:
            thread = threading.Thread(target=self._peer, args=(conn,), daemon=True)
            thread.name = "snapshot-peer"
            thread.start()
        except RuntimeError:  # out of threads: drop it, as a stranger
            self._peers.release()
            conn.close()
            self.log("dropped a peer connection: cannot start a thread")

    def _peer(self, conn: socket.socket) -> None:
        try:
            with conn, contextlib.suppress(OSError, ProtocolError, ConnectionError):
                while True:  # (the acceptor set TCP_NODELAY)
                    conn.settimeout(IDLE_SECONDS)
                    msg = recv_frame(conn)
                    conn.settimeout(PEER_TIMEOUT)
                    op = msg.get("op")
                    if op == "put":
                        self._put(conn, msg)
                    elif op == "get":
                        self._get(conn, msg)
                    else:
                        raise ProtocolError(f"unknown op {op!r}")
        finally:
            self._peers.release()

    def _put(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        rank, world, key, nbytes = _target(msg)
        keep = _key_or_none(msg.get("keep"))
        slot = self.records.begin(rank, world, key, nbytes, keep)
        try:
            recv_into(conn, slot.mapping()[:nbytes])
        except BaseException:  # Ctrl-C too: the half-written slot is freed
            self.records.abort(slot)
            raise
        self.records.commit(rank, key, slot.index)
        send_frame(conn, {"ok": True})

    def _get(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        rank, world, key = _where(msg)
        slot = self.records.pin(rank, world, key)
        if slot is None:
            send_frame(conn, {"ok": False, "error": f"no complete snapshot {key} of rank {rank}"})
            return
        try:
            send_frame(conn, {"ok": True, "nbytes": slot.nbytes})
            send_from_fd(conn, slot.fd, slot.nbytes)
        finally:
            self.records.unpin(slot)


class LocalSession:
    """One worker's connection: its requests, one at a time, and its peer connections."""

    def __init__(self, server: Server, conn: socket.socket) -> None:
        self.server = server
        self.records = server.records
        self.conn = conn
        self.peers: dict[str, socket.socket] = {}

    def serve(self) -> None:
        try:
            while True:
                msg, fds = recv_local(self.conn)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    return
                self._handle(msg)
        except _PEER_GONE as exc:  # the worker died (or was stopped) mid-request: expected
            _debug.debug("a worker's connection ended: %s: %s", type(exc).__name__, exc)
        except (OSError, ValueError, ProtocolError) as exc:  # malformed data from a live peer
            self.server.log(f"dropped a worker connection: {type(exc).__name__}: {exc}")
        finally:
            for sock in self.peers.values():
                sock.close()
            self.conn.close()

    def _reply(self, msg: dict[str, Any], slot: Slot | None = None) -> None:
        if slot is None:
            send_local(self.conn, msg)
        else:
            msg.update(slot=slot.index, fid=slot.fid, size=slot.size, nbytes=slot.nbytes)
            send_local(self.conn, msg, [slot.fd])

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "hello":
            secret = bytes.fromhex(field(msg, "secret", str))
            if not secret or not self.server.learn_secret(secret):
                self._reply({"ok": False, "error": "this worker's RPC secret is not the node's"})
                return
            try:
                port = self.server.listen(field(msg, "host", str))
            except OSError as exc:
                self._reply({"ok": False, "error": f"cannot listen for peers: {exc}"})
                return
            self._reply({"ok": True, "port": port, "pid": os.getpid()})
        elif op == "begin":
            rank, world, key, nbytes = _target(msg)
            slot = self.records.begin(rank, world, key, nbytes, _key_or_none(msg.get("keep")))
            self._reply({"ok": True}, slot)
        elif op == "commit":
            self._commit(msg)
        elif op == "inventory":
            held = self.records.held_bytes()
            self._reply({"ok": True, "records": self.records.inventory(), "held": held})
        elif op == "open":
            rank, world, key = _where(msg)
            found = self.records.find(rank, world, key)
            self._reply({"ok": found is not None, "error": "not here"}, found)
        elif op == "fetch":
            self._fetch(msg)
        elif op == "prune":
            world, ranks = field(msg, "world", int), field(msg, "ranks", list)
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                raise ProtocolError("ranks must be ints")
            self.records.prune(world, set(ranks))
            self._reply({"ok": True})
        elif op == "restored":
            rank, world, key = _where(msg)
            self.records.restored(rank, world, key)
            self._reply({"ok": True})
        else:
            raise ProtocolError(f"unknown op {op!r}")

    def _commit(self, msg: dict[str, Any]) -> None:
        rank, key = field(msg, "rank", int), (field(msg, "gen", str), field(msg, "step", int))
        index, world = field(msg, "slot", int), field(msg, "world", int)
        if not self.records.commit(rank, key, index):
            self._reply({"ok": False, "error": "that write was not in progress"})
            return
        replica = msg.get("replica")
        if not isinstance(replica, str) or not replica:
            self._reply({"ok": True, "replica": "none"})
            return
        slot = self.records.pin(rank, world, key)
        if slot is None:  # rewritten already (cannot happen: the worker waits for us)
            self._reply({"ok": True, "replica": "failed", "error": "rewritten"})
            return
        try:
            error = self._push(replica, slot, msg)
        finally:
            self.records.unpin(slot)
        self._reply({"ok": True, "replica": "failed" if error else "ok", "error": error})

    def _push(self, addr: str, slot: Slot, msg: dict[str, Any]) -> str:
        header = {k: msg.get(k) for k in ("rank", "world", "gen", "step", "keep")}
        header.update(op="put", nbytes=slot.nbytes)
        for attempt in (0, 1):  # a cached connection may have been closed by the peer
            try:
                sock = self._peer(addr)
                send_frame(sock, header)
                send_from_fd(sock, slot.fd, slot.nbytes)
                answer = recv_frame(sock)
                return "" if answer.get("ok") is True else str(answer.get("error"))
            except (OSError, ConnectionError, ProtocolError, AuthError) as exc:
                self._forget(addr)
                if attempt or isinstance(exc, AuthError):
                    return f"{addr}: {type(exc).__name__}: {exc}"
        return "unreachable"

    def _fetch(self, msg: dict[str, Any]) -> None:
        rank, world, key = _where(msg)
        addr = field(msg, "source", str)
        try:
            sock = self._peer(addr)
            where = {"rank": rank, "world": world, "gen": key[0], "step": key[1]}
            send_frame(sock, {"op": "get", **where})
            answer = recv_frame(sock)
            if answer.get("ok") is not True:
                self._reply({"ok": False, "error": f"{addr}: {answer.get('error')}"})
                return
            nbytes = field(answer, "nbytes", int)
            slot = self.records.begin(rank, world, key, nbytes, None)
            try:
                recv_into(sock, slot.mapping()[:nbytes])
            except BaseException:  # Ctrl-C too: the half-written slot is freed
                self.records.abort(slot)
                raise
            self.records.commit(rank, key, slot.index)
        except (OSError, ConnectionError, ProtocolError, AuthError) as exc:
            self._forget(addr)
            self._reply({"ok": False, "error": f"{addr}: {type(exc).__name__}: {exc}"})
            return
        self._reply({"ok": True}, slot)

    def _peer(self, addr: str) -> socket.socket:
        sock = self.peers.get(addr)
        if sock is not None:
            return sock
        secret = self.server.secret
        if secret is None:
            raise AuthError("no secret yet")
        sock = _connect(addr, secret)
        sock.settimeout(PEER_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peers[addr] = sock
        return sock

    def _forget(self, addr: str) -> None:
        sock = self.peers.pop(addr, None)
        if sock is not None:
            sock.close()


def _connect(addr: str, secret: bytes) -> socket.socket:
    """An authenticated connection to the snapshot server at ``addr``; tried again once when
    the server drops it during the handshake (strangers beside us filled its places)."""
    try:
        return _handshaken(addr, secret)
    except ConnectionResetError:
        time.sleep(GRACE)  # theirs are old by then: ours keeps its place
        return _handshaken(addr, secret)


def _handshaken(addr: str, secret: bytes) -> socket.socket:
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + CONNECT_SECONDS
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
    try:
        client_handshake(sock, secret, deadline)
    except BaseException:  # Ctrl-C too: the socket is closed
        sock.close()
        raise
    return sock


def _where(msg: dict[str, Any]) -> tuple[int, int, Key]:
    rank, world = field(msg, "rank", int), field(msg, "world", int)
    if rank < 0 or world < 1 or rank >= world:
        raise ProtocolError(f"rank {rank} of world {world}")
    return rank, world, (field(msg, "gen", str), field(msg, "step", int))


def _target(msg: dict[str, Any]) -> tuple[int, int, Key, int]:
    rank, world, key = _where(msg)
    nbytes = field(msg, "nbytes", int)
    if not 0 < nbytes <= _MAX_SNAPSHOT:
        raise ProtocolError(f"snapshot size {nbytes}")
    return rank, world, key, nbytes


def _key_or_none(value: Any) -> Key | None:
    if value is None:
        return None
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
    ):
        return value[0], value[1]
    raise ProtocolError(f"bad key {value!r}")


def _accept_loop(listener: socket.socket, handle: Any, name: str) -> None:
    """Accept forever, one thread per connection; out of descriptors: back off, no spin.
    Out of threads (``can't start new thread``: a flood of connections under a pids or
    memory limit) the connection is dropped and the loop backs off too: ending here would
    leave the listener open and never accept a peer again."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.1)
            continue
        try:
            threading.Thread(target=handle, args=(conn,), daemon=True, name=name).start()
        except RuntimeError:
            conn.close()
            time.sleep(0.1)
