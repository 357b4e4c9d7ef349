"""A replica group's stopped ranks, told by their agents through the group's own store.

When a worker of a group is stopped (SIGSTOP, ^Z, a debugger), its agent tells the
lighthouse, which leaves the group out at once. For rank 0 that holds: its heartbeat stops
with it, and it cannot ask. Any other rank's stop leaves rank 0 beating and asking, and
either brings the group back (the lighthouse does not believe a notice about a group that
still beats or asks: anyone with store access can write one), so the other groups waited
in their collectives with the stopped rank until it was run again. So the agent first
marks the rank stopped in the group's store (``stopped/<rank>``, ``1``), then tells the
lighthouse, and marks it ``0`` when the rank runs again; rank 0 neither beats nor asks
while another rank of its group is marked stopped (:func:`stopped_ranks`). A rank marks
itself running when its manager starts (a rank killed while stopped is started again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

from rallypoint._core.store import Store
from rallypoint._core.torch_c import PrefixStore, TCPStore

__all__ = [
    "GROUP_PREFIX",
    "any_marked",
    "mark",
    "mark_from_record",
    "mark_keys",
    "runs_check",
    "stopped_ranks",
    "until_running",
]

GROUP_PREFIX = "rallypoint-ft/"
"""The prefix of the ``Manager``'s keys in its group's store."""


def _key(rank: int) -> str:
    return f"stopped/{rank}"


def mark(group: Store, rank: int, stopped: bool) -> None:
    """Mark ``rank`` stopped or running in the group's store (``group``: prefixed)."""
    group.set(_key(rank), b"1" if stopped else b"0")


def mark_keys(world_size: int, own: int) -> list[str]:
    """The marks of the group's ranks other than ``own``."""
    return [_key(r) for r in range(world_size) if r != own]


def any_marked(values: list[bytes]) -> bool:
    """Whether any of the marks read (as :func:`mark_keys` names them) says stopped."""
    return any(bytes(value) == b"1" for value in values)


def stopped_ranks(group: Store, world_size: int, own: int) -> list[int]:
    """The ranks of the group other than ``own`` that are marked stopped (a rank whose
    manager has not started yet has no mark: running)."""
    ranks = [r for r in range(world_size) if r != own]
    keys = [_key(r) for r in ranks]
    if not ranks or not group.check(keys):
        return []
    values = group.multi_get(keys)
    return [r for r, value in zip(ranks, values, strict=True) if bytes(value) == b"1"]


def runs_check(group: Store, world_size: int, rank: int) -> Callable[[], bool] | None:
    """For rank 0's heartbeat: whether no other rank of the group is marked stopped, on a
    connection of its own (``None``: a group of one rank, nothing to check)."""
    if world_size == 1:
        return None
    own = group.clone()

    def runs() -> bool:
        try:
            return not stopped_ranks(own, world_size, rank)
        except Exception:  # the group's store is away: beat (the job's own liveness)
            return True

    return runs


def until_running(
    group: Store, world_size: int, rank: int, wait: float, say: Callable[[str], None]
) -> None:
    """Before rank 0 asks: until no other rank of the group is marked stopped, told to
    ``say`` once (``TimeoutError`` after ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    said: list[int] = []
    while stopped := stopped_ranks(group, world_size, rank):
        if said != stopped:
            said = stopped
            say(f"waits for its rank {stopped[0]}, stopped, to run")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rallypoint.ft: rank {stopped[0]} of this group stays stopped")
        time.sleep(0.05)


def mark_from_record(record: str, rank: int, stopped: bool, timeout: float = 5.0) -> bool:
    """The agent's side: mark ``rank`` in the group's store named in ``record`` (what the
    worker wrote: its ``group_store``); ``False`` when the record names none."""
    try:
        host, _, port = str(json.loads(record)["group_store"]).rpartition(":")
        port_ = int(port)
    except (ValueError, KeyError, TypeError):
        return False
    store = TCPStore(
        host.strip("[]"),
        port_,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    mark(PrefixStore(GROUP_PREFIX, store), rank, stopped)
    return True
