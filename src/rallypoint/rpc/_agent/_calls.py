"""Outstanding calls: registration, completion, per-call timeouts and failing them in bulk.

A pending call costs no Python object of its own, because the GC's full collections scan
every long-lived tracked object: a request id maps to its connection in
:attr:`PendingCalls.owners` and to its future in that connection's ``pending`` dict, and
deadlines are tuples of numbers (untracked by the GC) in a FIFO for the default timeout
or a heap for per-call ones. Whoever pops a request id from ``owners`` first (the reply,
the timeout, the broken connection or shutdown) completes the future; the others find
nothing.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import threading
import time
from typing import Any

import torch

from rallypoint.rpc._errors import RpcError, RpcTimeoutError
from rallypoint.rpc._transport._connection import Connection
from rallypoint.rpc._wait_all import record_failure


def _raise(exc: BaseException) -> None:
    raise exc


def fail(future: torch.futures.Future[Any], exc: BaseException) -> None:
    """Complete ``future`` with ``exc`` unless it is already complete.

    Calls return the C++ future type, as torch's ``rpc_async`` does; it has no
    ``set_exception``, so this does what ``torch.futures.Future.set_exception`` does: the
    exception is the value, and an unwrap function raises it from ``wait()``/``value()``.
    ``torch.futures.wait_all`` learns of the failure at once (see :mod:`._wait_all`).
    """
    if future.done():
        return
    record_failure(future)
    with contextlib.suppress(Exception):  # completed meanwhile
        future._set_unwrap_func(_raise)
        future.set_result(exc)


class PendingCalls:
    """The calls this agent sent and has no reply for yet."""

    def __init__(self, default_timeout: float) -> None:
        self.default_timeout = default_timeout
        self.owners: dict[int, Connection] = {}
        self._heap: list[tuple[float, int, float]] = []
        self._fifo: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.owners)

    def add(
        self, rid: int, conn: Connection, future: torch.futures.Future[Any], seconds: float
    ) -> None:
        """Register call ``rid`` on ``conn``; ``seconds`` > 0 arms its timeout."""
        conn.pending[rid] = future
        self.owners[rid] = conn
        if seconds > 0:
            deadline = time.monotonic() + seconds
            with self._lock:
                if seconds == self.default_timeout:
                    self._fifo.append((deadline, rid))
                else:
                    heapq.heappush(self._heap, (deadline, rid, seconds))

    def set_default(self, seconds: float) -> None:
        """A new default timeout for calls registered from now on; those pending keep
        their deadlines (they move to the heap, so the FIFO stays in deadline order)."""
        with self._lock:
            for deadline, rid in self._fifo:
                heapq.heappush(self._heap, (deadline, rid, self.default_timeout))
            self._fifo.clear()
            self.default_timeout = seconds

    def pop(self, rid: int) -> torch.futures.Future[Any] | None:
        """Take call ``rid`` out; its future, or ``None`` if someone else completed it."""
        conn = self.owners.pop(rid, None)
        if conn is None:
            return None
        return conn.pending.pop(rid, None)

    def fail_connection(self, conn: Connection, error: BaseException) -> None:
        """Fail every call pending on ``conn`` (it broke or is closing)."""
        for rid in list(conn.pending):
            if self.owners.pop(rid, None) is not None:
                future = conn.pending.pop(rid, None)
                if future is not None:
                    fail(future, error)

    def fail_all(self) -> None:
        """Fail every pending call: the agent is shutting down."""
        for rid, conn in dict(self.owners).items():  # callers may still add calls
            future = self.pop(rid)
            if future is not None:
                fail(
                    future,
                    RpcError(f"RPC to {conn.peer_name} was cancelled: RPC has been shut down"),
                )

    def expire(self, now: float) -> None:
        """Fail the calls whose deadline passed (called by the agent's monitor)."""
        owners = self.owners
        if not owners and not self._heap and not self._fifo:
            return  # the usual tick of an idle caller
        expired: list[tuple[int, float]] = []
        with self._lock:
            heap = self._heap
            while heap and heap[0][0] <= now:
                _, rid, seconds = heapq.heappop(heap)
                expired.append((rid, seconds))
            if len(heap) > 2 * len(owners) + 1024:
                self._heap = [e for e in heap if e[1] in owners]
                heapq.heapify(self._heap)
            fifo = self._fifo
            while fifo and (fifo[0][0] <= now or fifo[0][1] not in owners):
                deadline, rid = fifo.popleft()
                if deadline <= now:
                    expired.append((rid, self.default_timeout))
            if len(fifo) > 2 * len(owners) + 1024:
                self._fifo = collections.deque(e for e in fifo if e[1] in owners)
        for rid, seconds in expired:
            conn = owners.get(rid)
            future = self.pop(rid)
            if conn is None or future is None:
                continue
            fail(
                future,
                RpcTimeoutError(
                    f"RPC ran for more than set timeout ({int(seconds * 1000)} ms) and "
                    f"will now be marked with an error (call to {conn.peer_name})"
                ),
            )
