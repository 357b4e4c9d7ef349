"""At most one line per interval: messages a failing disk or a flood of strangers would
otherwise repeat on every write or connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

__all__ = ["Throttle"]


class Throttle:
    """:meth:`ready` is true at most once per ``every`` seconds for each key (thread-safe)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def ready(self, key: Hashable = None) -> bool:
        """Whether a line for ``key`` may go out now (then the interval starts again)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                return False
            self._last[key] = now
            return True
