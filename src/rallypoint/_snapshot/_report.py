"""Messages of the snapshot part: one line on stderr, each kind at most once per process."""

from __future__ import annotations

import contextlib
import sys
import threading

__all__ = ["Reporter"]

PREFIX = "rallypoint.snapshot: "


class Reporter:
    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def once(self, kind: str, text: str) -> None:
        """Print ``text`` unless a message of ``kind`` was printed already."""
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        self.always(text)

    def always(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(PREFIX + text + "\n")
            sys.stderr.flush()
