"""The launcher's signals: SIGINT/SIGTERM/... are queued and wake the monitor loop.

A signal that comes again within :data:`ECHO` seconds is one signal sent twice by one
sender, not a second request: ``timeout`` sends its SIGTERM to the launcher and then to the
launcher's process group, and ``srun`` forwards the one it got to the tasks that the job
step's own SIGTERM reaches too. It is queued once. A second signal after that (a user's
second Ctrl-C) is queued, and an attempt that is stopping its workers then kills them at
once (``_attempt``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from typing import Any

from rallypoint._core.closing import Closing

__all__ = ["ECHO", "SignalQueue"]

ECHO = 1.0
"""Seconds within which the same signal again is the same signal (see the docstring)."""


class SignalQueue(Closing):
    """Queue ``signums`` while open; :meth:`close` restores the previous handlers.

    ``wake_fd`` (the read end of a pipe, readable after any signal) lets a ``select`` loop
    wake up at once; it is ``None`` outside the main thread, where nothing is installed.
    """

    def __init__(self, signums: tuple[int, ...]) -> None:
        self._queue: deque[int] = deque()
        self._last: dict[int, float] = {}
        """When each signal was last queued."""
        self._old: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w)
        for signum in signums:
            self._old[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if now - self._last.get(signum, -ECHO) >= ECHO:
            self._last[signum] = now
            self._queue.append(signum)

    @property
    def wake_fd(self) -> int | None:
        return None if self._pipe is None else self._pipe[0]

    def pop(self) -> int | None:
        """The oldest signal not yet handled, or ``None``."""
        return self._queue.popleft() if self._queue else None

    def raise_if_signalled(self, waiting_for: str) -> None:
        """Raise :class:`LaunchInterruptedError` for the oldest signal not handled yet."""
        signum = self.pop()
        if signum is not None:
            from rallypoint._supervise._errors import LaunchInterruptedError

            raise LaunchInterruptedError(
                f"received {signal.Signals(signum).name} while waiting for {waiting_for}; stopped",
                signum=signum,
            )

    def pending(self) -> bool:
        """Whether a signal waits to be handled (without taking it)."""
        return bool(self._queue)

    def drain_wake_fd(self) -> None:
        if self._pipe is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._pipe[0], 512)

    def close(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None
