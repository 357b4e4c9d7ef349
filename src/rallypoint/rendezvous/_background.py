"""One background thread per handler: heartbeats, last-call timers and liveness checks.

Tasks get the thread's own store connection (a clone), so they never queue behind the
handler's blocking ``wait``. A task that raises is logged and, if periodic, retried at
its next interval; it never kills the thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger("rallypoint.rendezvous")

C = TypeVar("C")


class Background(Generic[C]):
    """A small scheduler thread; ``connect()`` makes the context handed to every task."""

    def __init__(self, name: str, connect: Callable[[], C]) -> None:
        self._name = name
        self._connect = connect
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, float | None, Callable[[C], None]]] = []
        self._seq = itertools.count()
        self._cancelled: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_at(self, when: float, fn: Callable[[C], None], every: float | None = None) -> int:
        """Run ``fn(ctx)`` at monotonic time ``when`` (then each ``every`` s); return an id."""
        with self._cond:
            if self._stopped:
                return -1
            seq = next(self._seq)
            heapq.heappush(self._heap, (when, seq, every, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return seq

    def cancel(self, task_id: int) -> None:
        with self._cond:
            self._cancelled.add(task_id)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        ctx: C | None = None
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(delay)
                if self._stopped:
                    return
                _, seq, every, fn = heapq.heappop(self._heap)
                if seq in self._cancelled:
                    self._cancelled.discard(seq)
                    continue
                if every is not None:
                    heapq.heappush(self._heap, (time.monotonic() + every, seq, every, fn))
            try:
                if ctx is None:
                    ctx = self._connect()
                fn(ctx)
            except Exception:
                logger.warning("rendezvous background task failed", exc_info=True)
