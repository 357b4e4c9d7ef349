"""Module-level locks that a forked child finds free.

``fork()`` copies only the thread that calls it, so a lock another thread held at that
moment stays held in the child for good. rallypoint's processes fork while threads of
theirs run (the warm process and the test harness fork workers, a ``DataLoader`` forks
beside RPC reader threads), so a module lock such threads take must be
:func:`fork_safe_lock`: a ``threading.Lock`` re-created free in every child, as the
standard library does for its own module locks (``logging``, ``concurrent.futures``).
"""

from __future__ import annotations

import os
import threading

__all__ = ["fork_safe_lock"]


def fork_safe_lock() -> threading.Lock:
    """A new lock that every process forked from this one finds free.

    What the lock guards must then be valid in the child whatever the other thread was
    doing: single operations on dicts and sets are (the GIL makes them whole), and a module
    whose state belongs to the parent's threads forgets it in the child
    (``register_at_fork``). A lock held by the forking thread itself must not be one of
    these: the child would find it free while it is still inside its ``with`` block.
    """
    lock = threading.Lock()
    os.register_at_fork(after_in_child=lock._at_fork_reinit)  # type: ignore[attr-defined]
    return lock
