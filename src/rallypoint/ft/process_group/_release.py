"""Dropping an aborted communicator without waiting for it.

torch's gloo process group waits, in its destructor, for the collectives still queued or
in flight on it, up to its timeout; gloo can leave a receive posted as its peer died
unwoken by the abort (seen: 10 s, the timeout, in the thread that dropped the group). The
last reference to an aborted communicator is therefore dropped on a thread of its own.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["release"]


def release(box: list[Any]) -> None:
    """Empty ``box`` (which holds the last references to aborted communicators) on a
    daemon thread, so that their destructors never block the caller."""
    if any(item is not None for item in box):
        threading.Thread(target=box.clear, name="rallypoint-ft-release", daemon=True).start()
