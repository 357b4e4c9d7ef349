"""Module-level locks that a forked child finds free.

``fork()`` copies only the thread that calls it. A lock that another thread held at that
moment stays held in the child, by a thread that does not exist there, and the child's
first ``with lock:`` blocks for good. rallypoint's processes fork while threads of theirs
run: the launcher's warm process and the test harness fork workers, a ``DataLoader`` forks
its workers beside RPC reader threads, and a store connect abandoned by
:func:`~rallypoint._core.blocking.call_in_thread` ends, and takes that module's lock, at
any moment: a worker that inherits the held lock blocks in its first ``call_in_thread``,
and the other workers wait for it in the rendezvous.

:func:`fork_safe_lock` is a ``threading.Lock`` that is re-created free in every child, as
the standard library does for its own module locks (``logging``, ``concurrent.futures``).
What a lock guards must then be valid in the child whatever the other thread was doing:
single operations on dicts and sets are (the GIL makes them whole), and a module whose
state belongs to the parent's threads forgets it in the child (``register_at_fork``).
A lock held by the *forking* thread must not be one of these: the child would find it
free while it is still inside its ``with`` block.
"""

from __future__ import annotations

import os
import threading

__all__ = ["fork_safe_lock"]


def fork_safe_lock() -> threading.Lock:
    """A new lock that every process forked from this one finds free."""
    lock = threading.Lock()
    os.register_at_fork(after_in_child=lock._at_fork_reinit)  # type: ignore[attr-defined]
    return lock
