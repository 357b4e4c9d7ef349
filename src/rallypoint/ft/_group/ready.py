"""Every rank of a replica group begins a step before its rank 0 asks for the step's quorum.

Rank 0 asks for the whole group. A rank whose training thread hangs (a deadlock, a stuck
data loader) while rank 0 goes on asking kept the group in every quorum, so the other
groups stood in their collectives with it for as long as it hung. Now each other rank
counts itself in (``ready/<member>/<seq>``, one ``add``; the last one in writes
``.../all``) and rank 0 waits on that before it asks: a group with a hung rank goes silent
while it beats, and the lighthouse goes on without it after its join timeout (torchft's
manager server also asks only once every rank of its group has). Keys are named by the
group's member id, which is new in each life of the group, so a restart never reads an
earlier life's count.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import DistStoreError

from rallypoint._core.store import Store

__all__ = ["count_in", "until_ready"]


def _key(member: str, seq: int) -> str:
    return f"ready/{member}/{seq}"


def count_in(group: Store, member: str, seq: int, world_size: int) -> None:
    """A rank other than 0 begins step ``seq`` (one store round trip; two for the last)."""
    if group.add(_key(member, seq), 1) == world_size - 1:
        group.set(_key(member, seq) + "/all", b"1")


def until_ready(
    group: Store, member: str, seq: int, world_size: int, wait: float, replica_id: str
) -> None:
    """Rank 0: until every other rank of the group began step ``seq``, for up to ``wait``
    seconds (then ``TimeoutError``, in one line); the counts of the step before are
    deleted (every rank is past them). A group of one rank has nobody to wait for."""
    if world_size == 1:
        return
    key = _key(member, seq)
    try:
        group.wait([key + "/all"], timedelta(seconds=wait))
    except DistStoreError:  # c10d's wait timed out (a store that is gone raises its own)
        began = group.add(key, 0)
        raise TimeoutError(
            f"rallypoint.ft: group {replica_id}: {began} of its {world_size - 1} other rank(s) "
            f"began step {seq} within {wait:g} s: a rank is hung, say (a deadlock); the "
            "lighthouse goes on without the group"
        ) from None
    if seq >= 1:
        for old in (_key(member, seq - 1), _key(member, seq - 1) + "/all"):
            group.delete_key(old)
