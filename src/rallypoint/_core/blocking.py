"""Blocking calls that must not hold the calling thread hostage.

A call into torch's ``TCPStore`` (a connect, its ``ping``, a ``get`` on a server that
accepted the connection and never answers) blocks in C++ ``recv`` and retries on
``EINTR``: Python's signal handlers do not run until it returns, and the store's own
timeout does not bound every step. :func:`call_in_thread` runs such a call in a daemon
thread while the caller waits in short slices, so the caller keeps its own deadline and
can give up when ``poll()`` raises (a signal arrived). A call given up on is left to
finish in its thread (nothing can interrupt it), and its result is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["InThread", "call_in_thread"]

T = TypeVar("T")

POLL_EVERY = 0.05
"""Seconds between two ``poll()`` calls while a call runs in its thread."""


class InThread(Generic[T]):
    """``fn()`` started in a daemon thread; :meth:`wait` for it, then take its :meth:`result`."""

    def __init__(self, fn: Callable[[], T], *, name: str) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.started = time.monotonic()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the caller
            self._error = exc
        finally:
            self._done.set()

    @property
    def age(self) -> float:
        """Seconds since the call started."""
        return time.monotonic() - self.started

    def wait(self, timeout: float | None) -> bool:
        """Whether the call has finished, waiting up to ``timeout`` seconds for it."""
        return self._done.wait(timeout)

    def result(self) -> T:
        """What the call returned, or raise what it raised (call after :meth:`wait`)."""
        assert self._done.is_set(), "the call is still running"
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value  # type: ignore[return-value]  # set when no error


def call_in_thread(
    fn: Callable[[], T],
    *,
    timeout: float | None = None,
    poll: Callable[[], None] | None = None,
    name: str = "rallypoint-blocking",
) -> T:
    """``fn()`` in a daemon thread; returns its result or raises its exception.

    While it runs, ``poll()`` is called every 50 ms (raise from it to give up); after
    ``timeout`` seconds :class:`TimeoutError` is raised. Either way the call is abandoned,
    not stopped.
    """
    call = InThread(fn, name=name)
    deadline = None if timeout is None else call.started + timeout
    while True:
        step = POLL_EVERY
        if deadline is not None:
            step = max(0.0, min(step, deadline - time.monotonic()))
        if call.wait(step):
            return call.result()
        if poll is not None:
            poll()
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no result within {timeout:g} s")
