"""Busy-polling while this process waits: who may spin, when it pays, and the spin itself.

Every rallypoint thread that blocks says so here (:meth:`Waits.blocked`). A thread that
starts to wait may first busy-poll for up to ``busy_poll_us`` if every other Python thread
of the process is blocked in such a wait (a spinner takes the GIL constantly) and if
recent idle gaps at the same site mostly ended within that window (:class:`SpinPolicy`).
The spin polls every socket the process waits on, yielding the CPU between polls, and ends
on the thread's own event, when another thread needs the GIL, or at the window's end. A
contended CPU makes the thread block and pauses spinning for the whole process.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
from collections.abc import Callable

READY, OTHER, TIMEOUT = 0, 1, 2
_POLLIN = select.POLLIN
_clock = time.perf_counter
_POLLERS_KEPT = 8
CONTENDED_S = 0.002
"""A yield that took longer than this: another task held the CPU (see the docstring)."""
PAUSE_MIN_S = 0.02
PAUSE_MAX_S = 1.0
"""No spinning for a pause after a spin found the CPU taken: doubled from the first to the
last while it keeps happening."""
UNCONTENDED_S = 0.0001
"""A spin that yielded for this long without losing the CPU resets the pause."""
_local = threading.local()


class SpinPolicy:
    """Whether an idle gap that begins at a site is worth spinning through: yes while at
    least half of the last :data:`HISTORY` gaps that began there ended within the window
    (a site not seen yet: yes). Gaps count whether a thread spun through them or slept,
    so spinning resumes when the traffic picks up again."""

    HISTORY = 8
    SITES = 256  # more sites than this (many distinct functions): start over

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._hits: dict[int, int] = {}  # id(site) -> the last gaps, 1 bit each

    def worth_it(self, site: object = None) -> bool:
        if self.window_s <= 0:
            return False
        hits = self._hits.get(id(site))
        return hits is None or hits.bit_count() * 2 >= self.HISTORY

    def record(self, hit: bool, site: object = None) -> None:
        key = id(site)  # sites are functions and constants: identity, never equality
        hits = self._hits.get(key, (1 << self.HISTORY) - 1)
        if len(self._hits) >= self.SITES and key not in self._hits:
            self._hits.clear()
        self._hits[key] = ((hits << 1) | hit) & ((1 << self.HISTORY) - 1)


class Waits:
    """The waits of this process's rallypoint threads (one instance: :data:`WAITS`)."""

    def __init__(self) -> None:
        self.policy = SpinPolicy(0.0)
        # thread ident -> the sockets it waits on (none: a lock, a sleep); one entry per
        # thread, set and removed by that thread (or by the one that wakes it), so plain
        # dict operations under the GIL keep it consistent
        self._blocked: dict[int, tuple[int, ...]] = {}
        self._woken = 0  # counts waits that ended with work to do (see blocked)
        self._gap: tuple[float, object] | None = None  # the process's idle gap: start, site
        self._calm_at = 0.0  # no spin before this: a yield found the CPU taken
        self._pause = PAUSE_MIN_S  # the next such pause
        self.contended = 0  # spins that ended because the CPU was taken (tests read it)

    def forget_other_threads(self) -> None:
        """In a forked child: only the thread that forked lives on, so nobody else waits
        (a child that counted its parent's waiting threads would spin beside real work)."""
        self._blocked.clear()
        self._gap = None

    def configure(self, window_s: float) -> None:
        """The agent's ``busy_poll_us``, in seconds (``0``: never spin)."""
        self.policy = SpinPolicy(window_s)

    def blocked(self, *fds: int, urgent: bool = True) -> Blocked:
        """The calling thread blocks meanwhile (``with WAITS.blocked(...):``), waiting for
        ``fds`` to become readable.

        ``urgent``: when the wait ends the thread has work (a frame, a credit) and a
        spinning thread must make room for it; periodic wake-ups (the monitor's tick, a
        poll of the store in ``shutdown()``) are not urgent: the spinner goes on, and
        the thread gets the GIL between its polls."""
        return Blocked(self, fds, urgent)

    def _unblocked(self, ident: int, urgent: bool) -> None:
        if self._blocked.pop(ident, None) is not None and urgent:
            self._woken += 1
            self._busy()

    def sleep(self, seconds: float) -> None:
        """``time.sleep``, as a wait."""
        with self.blocked(urgent=False):
            time.sleep(seconds)

    def waking(self, ident: int) -> None:
        """Thread ``ident`` is about to be woken (a lock it waits on is released): it
        needs the GIL soon, so nobody may start spinning for it."""
        if self._blocked.pop(ident, None) is not None:
            self._woken += 1
            self._busy()

    def _busy(self) -> None:
        """A thread got work: the process's idle gap (if any) ends now."""
        gap = self._gap
        if gap is not None:
            self._gap = None
            self.policy.record(_clock() - gap[0] <= self.policy.window_s, gap[1])

    def may_spin(self, site: object = None) -> bool:
        """Whether the calling thread, about to wait after ``site``, may spin (see the
        module docstring). If every other thread waits, the process's idle gap begins."""
        if len(self._blocked) < threading.active_count() - 1:
            return False
        now = _clock()
        self._gap = (now, site)
        return now >= self._calm_at and self.policy.worth_it(site)

    def spin(
        self, fd: int | None, done: Callable[[], bool] | None = None, limit_s: float = -1.0
    ) -> int:
        """Busy-poll until ``fd`` is readable or ``done()`` (:data:`READY`), another
        thread has work (:data:`OTHER`), the window passes or a yield finds the CPU taken
        (:data:`TIMEOUT`); never longer than ``limit_s`` (the caller's timeout; negative:
        none)."""
        woken = self._woken
        poll, clock, yield_cpu = self._poller(fd).poll, _clock, os.sched_yield
        window = self.policy.window_s
        now = began = clock()
        until = now + (window if limit_s < 0 else min(window, limit_s))
        try:
            while True:
                events = poll(0)
                if events:
                    self._busy()
                    for event in events:  # a loop, not any(): no generator to make
                        if event[0] == fd:
                            return READY
                    return OTHER
                if done is not None and done():
                    self._busy()
                    return READY
                if self._woken != woken:
                    return OTHER
                if now >= until:
                    return TIMEOUT
                yield_cpu()
                then, now = now, clock()
                if now - then > CONTENDED_S:
                    self._taken(now)
                    return TIMEOUT
        finally:
            if now - began >= UNCONTENDED_S and self._calm_at <= began:
                self._pause = PAUSE_MIN_S  # yielded a while and kept the CPU

    def _taken(self, now: float) -> None:
        """A yield found the CPU taken: nobody spins for a pause (see the docstring)."""
        self.contended += 1
        self._calm_at = now + self._pause
        self._pause = min(self._pause * 2, PAUSE_MAX_S)

    def _waited(self) -> list[tuple[int, ...]]:
        """The sockets of every blocked thread, copied: other threads start and stop
        waiting meanwhile. Iterating the dict itself failed (``dictionary changed size``)
        when a garbage collection amid the iteration ran Python code (a finalizer) and the
        interpreter switched threads there. Copying allocates nothing once it has begun;
        should that ever change, it is retried."""
        while True:
            try:
                return list(self._blocked.values())
            except RuntimeError:  # pragma: no cover - see the docstring
                continue

    def _poller(self, fd: int | None) -> select.poll:
        """A poll object for ``fd`` and every socket a blocked thread waits on (each
        thread keeps the last few it built: the same threads block on the same sockets)."""
        fds = frozenset(itertools.chain(itertools.chain.from_iterable(self._waited()), (fd,)))
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

    def wait_readable(
        self, fd: int, poller: select.poll, timeout_ms: int, site: object = None
    ) -> bool:
        """Until ``fd`` (registered in ``poller``) is readable (``True``) or ``timeout_ms``
        passes (``False``; ``-1``: no timeout): spin first if this thread may (the spin
        counts against the timeout)."""
        if self.may_spin(site):
            began = _clock()
            if self.spin(fd, limit_s=timeout_ms / 1000) == READY:
                return True
            if timeout_ms >= 0:
                timeout_ms = max(0, timeout_ms - int((_clock() - began) * 1000))
        with self.blocked(fd, urgent=False):
            ready = bool(poller.poll(timeout_ms))
        if ready:  # a frame: work (a timeout only lets a caller check its call)
            self._woken += 1
            self._busy()
        return ready

    def wait_lock(self, lock: threading.Lock, timeout: float, site: object = None) -> bool:
        """Acquire ``lock`` within ``timeout`` seconds (a latch released by another
        thread, which calls :meth:`waking` first): spin first if this thread may (the
        spin counts against the timeout)."""
        if self.may_spin(site):
            began = _clock()
            if self.spin(None, lambda: lock.acquire(blocking=False), timeout) == READY:
                return True
            if timeout >= 0:
                timeout = max(0.0, timeout - (_clock() - began))
        with self.blocked(urgent=False):  # the releaser calls waking first
            return lock.acquire(timeout=timeout)


class Blocked:
    """A wait of the calling thread, as a context manager (a class: a generator-based one
    costs twice the Python calls, and threads enter one for every wait)."""

    __slots__ = ("_fds", "_ident", "_urgent", "_waits")

    def __init__(self, waits: Waits, fds: tuple[int, ...], urgent: bool) -> None:
        self._waits = waits
        self._fds = fds
        self._urgent = urgent
        self._ident = 0

    def __enter__(self) -> None:
        self._ident = ident = threading.get_ident()
        self._waits._blocked[ident] = self._fds

    def __exit__(self, *exc_info: object) -> None:
        self._waits._unblocked(self._ident, self._urgent)


WAITS = Waits()
os.register_at_fork(after_in_child=WAITS.forget_other_threads)
