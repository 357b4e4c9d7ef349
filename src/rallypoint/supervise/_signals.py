"""The launcher's signals: SIGINT/SIGTERM/... are queued and wake the monitor loop."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import deque
from typing import Any

from rallypoint._core.closing import Closing

__all__ = ["SignalQueue"]


class SignalQueue(Closing):
    """Queue ``signums`` while open; :meth:`close` restores the previous handlers.

    ``wake_fd`` (the read end of a pipe, readable after any signal) lets a ``select`` loop
    wake up at once; it is ``None`` outside the main thread, where nothing is installed.
    """

    def __init__(self, signums: tuple[int, ...]) -> None:
        self._queue: deque[int] = deque()
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
            self._old[signum] = signal.signal(signum, lambda s, _f: self._queue.append(s))

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
            from rallypoint.supervise._errors import LaunchInterruptedError

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
