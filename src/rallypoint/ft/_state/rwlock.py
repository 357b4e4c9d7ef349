"""A readers-writer lock with a timeout (torchft's ``checkpointing._rwlock.RWLock``).

Any number of readers, or one writer; a writer waiting keeps new readers out. An acquire
that cannot be had within ``timeout`` seconds raises ``TimeoutError`` (``-1``: wait forever).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["RWLock"]


class RWLock:
    def __init__(self, timeout: float = -1) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def _wait(self, free: Callable[[], bool], what: str) -> None:
        deadline = None if self._timeout < 0 else time.monotonic() + self._timeout
        while not free():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"timed out waiting for the {what} lock")
            self._cond.wait(left)

    def r_acquire(self) -> None:
        with self._cond:
            self._wait(lambda: not self._writer and not self._writers_waiting, "read")
            self._readers += 1

    def r_release(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def w_acquire(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                self._wait(lambda: not self._writer and not self._readers, "write")
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
            self._writer = True

    def w_release(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    def w_locked(self) -> bool:
        return self._writer

    @contextmanager
    def r_lock(self) -> Iterator[None]:
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    @contextmanager
    def w_lock(self) -> Iterator[None]:
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()
