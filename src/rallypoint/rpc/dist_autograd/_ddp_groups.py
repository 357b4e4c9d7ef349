"""The process groups of DDP modules that a distributed backward reached: let go from
Python, never from the reducer's destructor.

torch frees a ``DistributedDataParallel`` module's ``Reducer`` with the GIL held
(pybind's ``dealloc_without_manipulating_gil``), and the reducer holds the module's
process group in C++. When it holds the group's last reference (the program called
``destroy_process_group()`` and then let the module go, as torch's own
``DdpComparisonTest`` does), ``~ProcessGroupGloo`` joins gloo's worker threads with the
GIL held. One of them may still be freeing a finished all-reduce whose tensor was made
in Python (``Join``'s counters, ``DDP._find_common_rank``) and whose Python object the
tensor now owns: dropping it needs the GIL, so the process hangs for good. It is torch's
race, with or without RPC (a loop of that test's body, four gloo ranks on two busy
CPUs, hangs within a few dozen iterations with no RPC at all, and on TensorPipe); the
busier the CPUs, the longer gloo's thread waits to run after waking the caller, and the
likelier the hang.

torch's Python wrapper of a process group drops its reference with the GIL released
(``IntrusivePtrNoGilDestructor``). So the first round that reaches a DDP module's
parameters has :data:`GROUPS` hold a Python reference to that module's group until the
module is gone (a ``weakref.finalize``: it runs before the module's attributes, the
reducer among them, are dropped), and drops it afterwards, when the agent's monitor ticks
or at ``shutdown()``: the group's last reference, if it is that, goes with the GIL
released, and gloo's threads finish before they are joined. At ``shutdown()`` the
groups of modules still alive are let go as well (nothing is held past the agent).
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
