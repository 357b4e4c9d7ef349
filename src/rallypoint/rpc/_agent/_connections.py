"""The authenticated sockets of one worker: the ones it accepts and the ones it opens.

Every connection answers the HMAC challenge (:mod:`rallypoint.rpc._transport._auth`) before its
first frame; accepted ones authenticate on the acceptor's thread
(:mod:`rallypoint.rpc._transport._acceptor`, which also bounds what unauthenticated peers cost). A
worker opens at most one connection to each peer for its own calls (on first use, over
the abstract Unix socket when the peer shares the host) and accepts the peers'
connections for theirs; frames from accepted connections wait until the group is known
(:meth:`Connections.accept_calls`). When a connection breaks, the calls pending on it
fail at once, naming the peer.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from typing import Any

from rallypoint.rpc._agent._calls import PendingCalls
from rallypoint.rpc._agent._peers import PeerTable
from rallypoint.rpc._errors import NOT_INITIALIZED, RpcConnectionError, RpcError
from rallypoint.rpc._group._groups import host_key
from rallypoint.rpc._options import RallypointRpcBackendOptions
from rallypoint.rpc._transport._acceptor import Acceptor
from rallypoint.rpc._transport._auth import client_handshake
from rallypoint.rpc._transport._connection import Connection, OnFrame, ReadInterrupted, connect
from rallypoint.rpc._transport._reader_pool import ReaderPool
from rallypoint.rpc._transport._shm import SegmentPool
from rallypoint.rpc._worker_info import WorkerInfo

logger = logging.getLogger("rallypoint.rpc")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a whole handshake may take, either way (connecting included when we open)."""


class Connections:
    """This worker's listener and its connections to and from peers."""

    def __init__(
        self,
        *,
        me: WorkerInfo,
        secret: bytes,
        host: str,
        options: RallypointRpcBackendOptions,
        peers: PeerTable,
        calls: PendingCalls,
        on_frame: OnFrame,
        pool: SegmentPool | None,
    ) -> None:
        self.stats: dict[str, int] = {
            "inline_tensor_bytes": 0,
            "shm_tensor_bytes": 0,
            "returned_tensor_bytes": 0,
        }
        self.host_key = host_key()
        self._me = me
        self._secret = secret
        self._peers = peers
        self._calls = calls
        self._unix_socket = options.unix_socket
        self._ready = threading.Event()
        self._readers = ReaderPool(max_parked=options.num_worker_threads)
        # every connection, either way, shares these
        self._connection = functools.partial(
            Connection,
            on_frame=on_frame,
            on_lost=self._lost,
            pool=pool,
            shm_threshold=options.shm_threshold,
            stats=self.stats,
            limiter=threading.Semaphore(options.num_worker_threads),
            readers=self._readers,
        )
        self._out: dict[str, Connection] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._inbound: set[Connection] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = Acceptor(host, secret, self._admit, deadline=HANDSHAKE_TIMEOUT)
        self.address = (host, self._acceptor.port)
        self.uds_name = self._acceptor.uds_name

    def accept_calls(self) -> None:
        """The group is known: let the frames of accepted connections run."""
        self._ready.set()

    # ---- outbound ----------------------------------------------------------------------
    def get(self, name: str) -> Connection:
        """The connection for calls to ``name`` (opened on first use)."""
        conn = self._out.get(name)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            lock = self._connect_locks.setdefault(name, threading.Lock())
        with lock:
            conn = self._out.get(name)
            if conn is not None and not conn.closed:
                return conn
            if self._closed:
                raise RpcError(NOT_INITIALIZED)
            conn = self._open(name)
            with self._lock:
                self._out[name] = conn
            conn.start()
            return conn

    def outbound(self, name: str) -> Connection | None:
        """The connection this worker opened to ``name``, if any."""
        return self._out.get(name)

    def opened(self) -> list[Connection]:
        """Every connection this worker opened (one per peer it called)."""
        with self._lock:
            return list(self._out.values())

    def _open(self, name: str) -> Connection:
        record = self._peers.record(name)
        same_host = record.host_key == self.host_key and self._unix_socket
        address: tuple[str, int] | str = record.uds if same_host else (record.host, record.port)
        try:
            sock, uds = connect(address, timeout=HANDSHAKE_TIMEOUT)
            hello = {"name": self._me.name, "id": self._me.id}
            client_handshake(sock, self._secret, hello, HANDSHAKE_TIMEOUT)
        except (OSError, RpcError) as exc:
            if isinstance(exc, ConnectionRefusedError):
                # nothing listens at its address: the process is gone (a dynamic member
                # that left with shutdown(graceful=False) or crashed is still listed)
                self._peers.mark_dead(name, "refused the connection (its process is gone)")
            reason = self._peers.dead_reason(name)
            detail = f" (it {reason})" if reason else ""
            raise RpcConnectionError(
                f"cannot reach worker {name} (rank {record.rank}){detail}: {exc}", peer=name
            ) from exc
        return self._connection(sock, peer_name=name, peer_id=record.rank, uds=uds, outbound=True)

    def drop(self, name: str) -> None:
        """``name`` left the group: close the connection to it."""
        with self._lock:
            conn = self._out.pop(name, None)
        if conn is not None:
            conn.close()

    # ---- inbound -----------------------------------------------------------------------
    def _admit(self, sock: socket.socket, uds: bool, hello: dict[str, Any]) -> None:
        """A peer authenticated (on the acceptor's thread): its frames get a reader."""
        try:
            peer_name, peer_id = str(hello["name"]), int(hello["id"])
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning(
                "rallypoint.rpc: %s rejected a connection with a bad hello: %r", self._me.name, exc
            )
            sock.close()
            return
        conn = self._connection(
            sock, peer_name=peer_name, peer_id=peer_id, uds=uds, gate=self._ready
        )
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._inbound.add(conn)
        conn.start()

    # ---- upkeep ------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """The monitor's turn: unblock stalled readers, send corked frames."""
        with self._lock:
            conns = [*self._out.values(), *self._inbound]
        for conn in conns:
            conn.upkeep(now)

    def _lost(self, conn: Connection, exc: BaseException | None) -> None:
        with self._lock:
            if self._out.get(conn.peer_name) is conn:
                del self._out[conn.peer_name]
            self._inbound.discard(conn)
            closing = self._closed
        outbound_eof = conn.outbound or isinstance(exc, EOFError | ConnectionError)
        # a peer that closed on purpose (it said so, or we cut into a frame) is alive
        on_purpose = conn.closing_on_purpose or isinstance(exc, ReadInterrupted)
        if not closing and exc is not None and outbound_eof and not on_purpose:
            self._peers.mark_dead(conn.peer_name, f"closed its connection ({exc or 'EOF'})")
        pending = list(conn.pending)
        if not pending:
            return
        reason = "this agent is shutting down" if closing else f"the connection broke: {exc}"
        error = RpcConnectionError(
            f"RPC to worker {conn.peer_name} (rank {conn.peer_id}) failed: {reason}; "
            f"{len(pending)} call(s) were pending",
            peer=conn.peer_name,
        )
        self._calls.fail_connection(conn, error)

    def close(self) -> bool:
        """Stop listening and close every connection; ``False`` if already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            conns = [*self._out.values(), *self._inbound]
            self._out.clear()
            self._inbound.clear()
        self._ready.set()
        self._acceptor.close()
        for conn in conns:
            conn.flush()
            conn.close()
        self._readers.close()
        return True
