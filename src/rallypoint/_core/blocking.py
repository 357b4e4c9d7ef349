"""Blocking calls that must not hold the calling thread hostage.

A call into torch's ``TCPStore`` blocks in C++ ``recv`` and retries on ``EINTR``: Python's
signal handlers do not run until it returns, and the store's own timeout does not bound
every step. :func:`call_in_thread` (or :class:`InThread`) runs such a call in a daemon
thread while the caller waits in short slices, so the caller keeps its own deadline and
handles signals. A call given up on is left to finish in its thread and its result is
dropped. At exit, calls still running are waited for a bounded time, because one that
finishes while the interpreter shuts down would kill the process. A forked child finds no
call running (:mod:`rallypoint._core.forking`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rallypoint._core.forking import fork_safe_lock

__all__ = ["InThread", "call_in_thread", "running_calls", "settle_before_fork"]

T = TypeVar("T")

POLL_EVERY = 0.05
"""Seconds between two ``poll()`` calls while a call runs in its thread."""

EXIT_WAIT_MAX = 60.0
"""Most seconds the interpreter waits at exit for calls still running in their threads."""

EXIT_WAIT_UNBOUNDED = 1.0
"""Seconds waited at exit for a running call that states no ``finishes_within``."""

_RUNNING: set[InThread[Any]] = set()
_RUNNING_LOCK = fork_safe_lock()


def _forget_the_parents_calls() -> None:
    """In a forked child: the parent's calls run in threads the child does not have, so
    its exit must not wait for them."""
    _RUNNING.clear()


os.register_at_fork(after_in_child=_forget_the_parents_calls)


class InThread(Generic[T]):
    """``fn()`` started in a daemon thread; :meth:`wait` for it, then take its :meth:`result`.

    ``finishes_within``: seconds by which ``fn`` is known to return (its own timeout),
    or ``None``; the interpreter waits for it at exit until then (see the module's doc).
    """

    def __init__(
        self, fn: Callable[[], T], *, name: str, finishes_within: float | None = None
    ) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.name = name
        self.started = time.monotonic()
        self.ends_by = None if finishes_within is None else self.started + finishes_within
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # SystemExit too: handed to the caller's thread
            self._error = exc
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)
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
    finishes_within: float | None = None,
) -> T:
    """``fn()`` in a daemon thread; returns its result or raises its exception.

    While it runs, ``poll()`` is called every 50 ms (raise from it to give up); after
    ``timeout`` seconds :class:`TimeoutError` is raised. Either way the call is abandoned,
    not stopped; ``finishes_within`` is as for :class:`InThread`.
    """
    call = InThread(fn, name=name, finishes_within=finishes_within)
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


def running_calls() -> list[str]:
    """Names of the calls still running in their threads (abandoned or not)."""
    with _RUNNING_LOCK:
        return sorted(call.name for call in _RUNNING)


def settle_before_fork(timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the calls running in threads that state when
    they end (``finishes_within``).

    For a process about to fork: a call in a store's C++ code may hold locks of the C++
    runtime (torch's connect resolves addresses and logs), which the child would inherit
    held by a thread it does not have, and the child's own connect would block on them
    for good. Calls with no stated end are most likely blocked in ``recv`` for good and
    are not waited for."""
    deadline = time.monotonic() + timeout
    while True:
        # held for microseconds, unless a thread of the caller's holds it for its own ends
        if not _RUNNING_LOCK.acquire(timeout=0.5):
            return
        try:
            bounded = [call for call in _RUNNING if call.ends_by is not None]
        finally:
            _RUNNING_LOCK.release()
        remaining = deadline - time.monotonic()
        if not bounded or remaining <= 0:
            return
        min(bounded, key=lambda call: call.ends_by or 0.0).wait(remaining)


def _wait_for_running_calls() -> None:
    """At exit: let calls still running end before the interpreter goes away.

    A thread returning from C++ into a finalized interpreter is ended with
    ``pthread_exit``, whose forced unwind through a ``noexcept`` frame calls
    ``std::terminate`` (exit status 134). So each call is waited for until the time by which
    it is known to end (``finishes_within``), never longer than :data:`EXIT_WAIT_MAX` in all;
    one with no such bound gets :data:`EXIT_WAIT_UNBOUNDED` (it is most likely blocked for
    good, and a thread still blocked when the process ends is harmless).
    """
    with _RUNNING_LOCK:
        calls = list(_RUNNING)
    if not calls:
        return
    now = time.monotonic()
    give_up = now + EXIT_WAIT_MAX
    ends = [now + EXIT_WAIT_UNBOUNDED if c.ends_by is None else c.ends_by for c in calls]
    ends = [min(end, give_up) for end in ends]
    if max(ends) - now > 1.0:
        names = ", ".join(sorted({c.name for c in calls}))
        print(
            f"rallypoint: waiting up to {max(ends) - now:.0f} s at exit for a call still "
            f"running in a thread ({names}); ending sooner would abort the interpreter",
            file=sys.stderr,
            flush=True,
        )
    for call, ends_by in zip(calls, ends, strict=True):
        call.wait(max(0.0, ends_by - time.monotonic()))


atexit.register(_wait_for_running_calls)
