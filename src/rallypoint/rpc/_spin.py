"""Busy-polling while this process waits: who may spin, when it pays, and the spin itself.

Every rallypoint thread that blocks says so here (:meth:`Waits.blocked`): a reader
waiting for the next frame, a caller for its reply, ``dist_autograd.backward`` for its
credit, the monitor between ticks, a worker in ``shutdown()``. A thread that starts to
wait may first busy-poll for up to ``busy_poll_us`` (the *window*) if

- every other Python thread of the process is blocked in such a wait. A spinning thread
  takes and drops the GIL hundreds of thousands of times a second, so a thread that
  needs it for real work crawls beside it (a ``Linear`` forward and backward ran 70%
  slower next to one): at most one thread per process spins, and none while user code
  runs on another thread; and
- most of the process's recent waits ended within the window (:class:`SpinPolicy`):
  spinning that does not pay only burns CPU.

The spin polls every socket that a thread of the process waits on, and yields the CPU
between polls (``sched_yield``): with more processes than cores (three pipeline workers
on two vCPUs) a spinner that does not yield takes the CPU from the very process that is
about to send (the step of ``benchmarks/rpc.py`` ran 2x slower); one that yields costs it
a context switch. It ends when the thread's own event happens (:data:`READY`), when
another waiting thread's socket becomes readable or another thread stops waiting
(:data:`OTHER`: that thread needs the GIL, so this one blocks), or when the window
passes (:data:`TIMEOUT`).

Why spin at all: a thread that blocks lets its CPU go idle, and a process that wakes up
on an idle CPU runs cold. On the 2-vCPU VM of the README, a chain of three processes
handing a message on, each running a small forward and backward pass, took 512 µs per
round with blocking reads and 293 µs when each waited by yielding busy-polls.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import threading
import time
from collections.abc import Callable, Iterator

READY, OTHER, TIMEOUT = 0, 1, 2
_POLLIN = select.POLLIN
_clock = time.perf_counter
_POLLERS_KEPT = 8
_local = threading.local()


class SpinPolicy:
    """Whether this process's waits are worth spinning for: yes while at least half of
    the last 16 ended within the window (a spin that timed out, or a blocking wait that
    took longer, is a miss). Blocking waits keep counting, so spinning resumes when the
    traffic picks up again."""

    HISTORY = 16

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._hits = (1 << self.HISTORY) - 1

    def worth_it(self) -> bool:
        return self.window_s > 0 and self._hits.bit_count() * 2 >= self.HISTORY

    def record(self, hit: bool) -> None:
        self._hits = ((self._hits << 1) | hit) & ((1 << self.HISTORY) - 1)


class Waits:
    """The waits of this process's rallypoint threads (one instance: :data:`WAITS`)."""

    def __init__(self) -> None:
        self.policy = SpinPolicy(0.0)
        # thread ident -> the sockets it waits on (none: a lock, a sleep); one entry per
        # thread, set and removed by that thread (or by the one that wakes it), so plain
        # dict operations under the GIL keep it consistent
        self._blocked: dict[int, tuple[int, ...]] = {}
        self._woken = 0  # counts waits that ended with work to do (see blocked)

    def configure(self, window_s: float) -> None:
        """The agent's ``busy_poll_us``, in seconds (``0``: never spin)."""
        self.policy = SpinPolicy(window_s)

    @contextlib.contextmanager
    def blocked(self, *fds: int, urgent: bool = True) -> Iterator[None]:
        """The calling thread blocks meanwhile (waiting for ``fds`` to become readable).

        ``urgent``: when the wait ends the thread has work (a frame, a credit) and a
        spinning thread must make room for it; periodic wake-ups (the monitor's tick, a
        poll of the store in ``shutdown()``) are not urgent: the spinner goes on, and
        the thread gets the GIL between its polls."""
        ident = threading.get_ident()
        self._blocked[ident] = fds
        try:
            yield
        finally:
            if self._blocked.pop(ident, None) is not None and urgent:
                self._woken += 1

    def sleep(self, seconds: float) -> None:
        """``time.sleep``, as a wait."""
        with self.blocked(urgent=False):
            time.sleep(seconds)

    def waking(self, ident: int) -> None:
        """Thread ``ident`` is about to be woken (a lock it waits on is released): it
        needs the GIL soon, so nobody may start spinning for it."""
        if self._blocked.pop(ident, None) is not None:
            self._woken += 1

    def may_spin(self) -> bool:
        """Whether the calling thread may spin now (see the module docstring)."""
        return self.policy.worth_it() and len(self._blocked) >= threading.active_count() - 1

    def spin(self, fd: int | None, done: Callable[[], bool] | None = None) -> int:
        """Busy-poll until ``fd`` is readable or ``done()`` (:data:`READY`), another
        thread has work (:data:`OTHER`) or the window passes (:data:`TIMEOUT`)."""
        woken = self._woken
        poll, clock, yield_cpu = self._poller(fd).poll, _clock, os.sched_yield
        until = clock() + self.policy.window_s
        while True:
            events = poll(0)
            if events:
                return READY if any(event[0] == fd for event in events) else OTHER
            if done is not None and done():
                return READY
            if self._woken != woken:
                return OTHER
            if clock() >= until:
                return TIMEOUT
            yield_cpu()

    def _poller(self, fd: int | None) -> select.poll:
        """A poll object for ``fd`` and every socket a blocked thread waits on (each
        thread keeps the last few it built: the same threads block on the same sockets)."""
        fds = frozenset(
            itertools.chain(itertools.chain.from_iterable(self._blocked.values()), (fd,))
        )
        cache: dict[frozenset[int | None], select.poll] | None = getattr(_local, "pollers", None)
        if cache is None:
            cache = _local.pollers = {}
        poller = cache.get(fds)
        if poller is None:
            if len(cache) >= _POLLERS_KEPT:
                cache.clear()
            poller = cache[fds] = select.poll()
            for one in fds:
                if one is not None:
                    poller.register(one, _POLLIN)
        return poller

    def wait_readable(self, fd: int, poller: select.poll, timeout_ms: int) -> bool:
        """Until ``fd`` (registered in ``poller``) is readable (``True``) or ``timeout_ms``
        passes (``False``; ``-1``: no timeout): spin first if this thread may."""
        policy = self.policy
        if self.may_spin():
            outcome = self.spin(fd)
            policy.record(outcome != TIMEOUT)
            if outcome == READY:
                return True
            with self.blocked(fd):
                return bool(poller.poll(timeout_ms))
        start = _clock()
        with self.blocked(fd):
            ready = bool(poller.poll(timeout_ms))
        policy.record(ready and _clock() - start <= policy.window_s)
        return ready

    def wait_lock(self, lock: threading.Lock, timeout: float) -> bool:
        """Acquire ``lock`` within ``timeout`` seconds (a latch released by another
        thread, which calls :meth:`waking` first): spin first if this thread may."""
        policy = self.policy
        if self.may_spin():
            outcome = self.spin(None, lambda: lock.acquire(blocking=False))
            policy.record(outcome != TIMEOUT)
            if outcome == READY:
                return True
            with self.blocked():
                return lock.acquire(timeout=timeout)
        start = _clock()
        with self.blocked():
            acquired = lock.acquire(timeout=timeout)
        policy.record(acquired and _clock() - start <= policy.window_s)
        return acquired


WAITS = Waits()
