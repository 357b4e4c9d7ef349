"""Aborting a communicator whose collective failed.

gloo tells no peer that a rank's collective failed: the rank leaves it, its links stay
up, and a peer that waits on it stays blocked until its own timeout (seen: 30 s in
torchft's resiliency tests, where torchft's Baby groups end their child process and so
close every link). A failed work therefore aborts its communicator, which closes its
links: every peer blocked on it fails at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["abort_on_failure"]


def abort_on_failure(work: Any, abort: Callable[[], None]) -> None:
    """Call ``abort`` (on a thread of its own: the callback runs on the backend's) once
    ``work`` fails; nothing for a work with no future (gloo's send and recv)."""
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):
        return

    def done(fut: Any) -> None:
        try:
            fut.value()
        except Exception:
            threading.Thread(target=abort, name="rallypoint-ft-abort", daemon=True).start()

    future.add_done_callback(done)
