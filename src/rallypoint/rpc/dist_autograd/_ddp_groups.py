"""The process groups of DDP modules that a distributed backward reached: let go from
Python, never from the reducer's destructor.

torch frees a DDP module's ``Reducer`` with the GIL held, and when the reducer holds the
process group's last reference, ``~ProcessGroupGloo`` joins gloo's threads with the GIL
held while one of them may need the GIL to free a finished all-reduce's Python tensor: the
process hangs for good (torch's race, with or without RPC). torch's Python wrapper drops
a group with the GIL released, so :data:`GROUPS` holds a Python reference to each reached
module's group until the module is gone, then drops it on the agent's monitor tick or at
``shutdown()``, so that gloo's threads finish before they are joined.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class GroupKeeper:
    """Holds the process groups of live DDP modules; lets them go after the modules."""

    def __init__(self) -> None:
        # reentrant: a garbage collection while it is held may free a module, whose
        # finalizer takes it again on the same thread
        self._lock = threading.RLock()
        self._held: dict[int, weakref.finalize[Any, Any]] = {}  # id(module) -> its finalizer
        self._due: list[Any] = []  # groups of modules that are gone, to let go

    def keep(self, ddp: Any) -> None:
        """Hold ``ddp``'s process group until ``ddp`` is gone (once per module)."""
        held = self._held.get(id(ddp))
        if held is not None and held.alive:
            return
        group = getattr(ddp, "process_group", None)
        if group is None:
            return
        finalizer = weakref.finalize(ddp, self._gone, id(ddp), group)
        finalizer.atexit = False  # at exit: torch's order, not a group kept to the end
        with self._lock:
            self._held[id(ddp)] = finalizer

    def _gone(self, key: int, group: Any) -> None:
        """``ddp`` is being freed, its reducer not yet: keep the group until later."""
        with self._lock:
            self._held.pop(key, None)
            self._due.append(group)

    def release_due(self) -> None:
        """Let go of the groups of the modules that are gone (any thread)."""
        if not self._due:
            return
        with self._lock:
            due, self._due = self._due, []
        # each group's last reference, if it is that, goes here with the GIL released
        del due

    def release_all(self) -> None:
        """At ``shutdown()``: let go of every group, those of live modules too."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for finalizer in held:
            finalizer.detach()  # the module still holds its group: no join here
        del held
        self.release_due()


GROUPS = GroupKeeper()
