"""Timeouts for futures, blocks of code and accelerator streams (torchft's ``futures``).

One timer thread per process runs every timeout (its callbacks must not block); a watchdog
ends the process with status 1 if that thread is stuck for ``TORCHFT_WATCHDOG_TIMEOUT_SEC``
(30 s): a timeout that cannot fire would leave a collective hanging for ever.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.futures import Future

__all__ = [
    "WATCHDOG_TIMEOUT_SEC",
    "context_timeout",
    "future_timeout",
    "future_wait",
    "stream_timeout",
]

T = TypeVar("T")

WATCHDOG_TIMEOUT_SEC = "TORCHFT_WATCHDOG_TIMEOUT_SEC"


class _TimeoutManager:
    """The timer thread (started on first use) and its watchdog."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, threading.Event, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._beat = 0
        """Bumped by the timer thread on every turn of its loop: the watchdog's evidence."""
        self._watchdog_interval = timedelta(seconds=int(os.environ.get(WATCHDOG_TIMEOUT_SEC, "30")))
        self._del_queue: queue.SimpleQueue[object] = queue.SimpleQueue()

    def schedule(self, delay: timedelta, callback: Callable[[], None]) -> threading.Event:
        """Run ``callback`` on the timer thread after ``delay`` unless the event returned is
        set first (it cancels the timeout)."""
        self._clear_del_queue()
        cancelled = threading.Event()
        with self._lock:
            self._start()
            deadline = time.monotonic() + delay.total_seconds()
            heapq.heappush(self._heap, (deadline, next(self._order), cancelled, callback))
            self._lock.notify_all()
        return cancelled

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ft-timeouts", daemon=True)
            self._thread.start()
            threading.Thread(
                target=self._watchdog, name="ft-timeouts-watchdog", daemon=True
            ).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._beat += 1
                now = time.monotonic()
                if not self._heap or self._heap[0][0] > now:
                    wait = min(self._heap[0][0] - now, 1.0) if self._heap else 1.0
                    self._lock.wait(wait)
                    continue
                _, _, cancelled, callback = heapq.heappop(self._heap)
            if not cancelled.is_set():
                callback()

    def _watchdog(self) -> None:
        while True:
            with self._lock:
                seen = self._beat
                self._lock.notify_all()  # wakes the timer thread: a live one bumps its beat
            time.sleep(self._watchdog_interval.total_seconds())
            with self._lock:
                stuck = self._beat == seen
            if stuck:
                sys.stderr.write("rallypoint.ft: the timeout thread is stuck: exiting\n")
                try:
                    sys.exit(1)
                except SystemExit:  # this is not the main thread: end the process itself
                    os._exit(1)
                return  # sys.exit was replaced (a test)

    def register(self, fut: Future[T], timeout: timedelta) -> Future[T]:
        """A future with ``fut``'s outcome, or ``TimeoutError`` after ``timeout``."""
        timed: Future[T] = Future()
        settled = threading.Lock()

        def settle(outcome: Callable[[Any], None], value: Any) -> None:
            if settled.acquire(blocking=False):  # the first outcome wins
                outcome(value)

        late = TimeoutError(f"future did not complete within {timeout}")
        timer = self.schedule(timeout, lambda: settle(timed.set_exception, late))

        def done(f: Future[T]) -> None:
            timer.set()
            try:
                value = f.wait()
            except Exception as exc:  # handed on to the timed future
                settle(timed.set_exception, exc)
            else:
                settle(timed.set_result, value)

        fut.add_done_callback(done)
        return timed

    def stream_timeout(self, callback: Callable[[], None], timeout: timedelta) -> None:
        if not torch.accelerator.is_available():
            return  # no stream runs behind the CPU's back: the work is done already
        event = torch.Event()
        event.record()

        def check() -> None:
            if not event.query():
                callback()
            self._del_queue.put(event)

        self.schedule(timeout, check)

    @contextlib.contextmanager
    def context_timeout(
        self, callback: Callable[[], None], timeout: timedelta
    ) -> Generator[None, None, None]:
        timer = self.schedule(timeout, callback)
        try:
            yield
        finally:
            timer.set()

    def _clear_del_queue(self) -> int:
        """Delete the events the timer thread is done with; how many."""
        count = 0
        while True:
            try:
                self._del_queue.get_nowait()
            except queue.Empty:
                return count
            count += 1


_TIMEOUT_MANAGER = _TimeoutManager()


def future_timeout(fut: Future[T], timeout: timedelta) -> Future[T]:
    """A future that completes as ``fut`` does, or with ``TimeoutError`` after ``timeout``."""
    return _TIMEOUT_MANAGER.register(fut, timeout)


def future_wait(fut: Future[T], timeout: timedelta) -> T:
    """``fut``'s result, waiting at most ``timeout`` (then ``TimeoutError``); its exception
    is raised here."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(timeout.total_seconds()):
        raise TimeoutError(f"future did not complete within {timeout}")
    return fut.wait()


def stream_timeout(callback: Callable[[], None], timeout: timedelta) -> None:
    """Call ``callback`` if the work queued so far on the current accelerator stream has not
    finished within ``timeout`` (on a CPU there is none: nothing to do)."""
    _TIMEOUT_MANAGER.stream_timeout(callback, timeout)


@contextlib.contextmanager
def context_timeout(
    callback: Callable[[], None], timeout: timedelta
) -> Generator[None, None, None]:
    """Call ``callback`` if the block has not ended within ``timeout``."""
    with _TIMEOUT_MANAGER.context_timeout(callback, timeout):
        yield
