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

import time
from collections.abc import Callable

from rallypoint._core.store import Store

__all__ = ["any_marked", "mark", "mark_keys", "runs_check", "stopped_ranks", "until_running"]


def _key(rank: int) -> str:
    return f"stopped/{rank}"


def mark(group: Store, rank: int, stopped: bool) -> None:
    """Mark ``rank`` stopped or running in the group's store (``group``: prefixed)."""
    group.set(_key(rank), b"1" if stopped else b"0")


def _others(world_size: int, own: int) -> list[int]:
    return [r for r in range(world_size) if r != own]


def _stopped(value: bytes) -> bool:
    return bytes(value) == b"1"


def mark_keys(world_size: int, own: int) -> list[str]:
    """The marks of the group's ranks other than ``own``."""
    return [_key(r) for r in _others(world_size, own)]


def any_marked(values: list[bytes]) -> bool:
    """Whether any of the marks read (as :func:`mark_keys` names them) says stopped."""
    return any(_stopped(value) for value in values)


def stopped_ranks(group: Store, world_size: int, own: int) -> list[int]:
    """The ranks of the group other than ``own`` that are marked stopped (a rank whose
    manager has not started yet has no mark: running)."""
    keys = mark_keys(world_size, own)
    if not keys or not group.check(keys):
        return []
    values = group.multi_get(keys)
    ranks = _others(world_size, own)
    return [r for r, value in zip(ranks, values, strict=True) if _stopped(value)]


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
