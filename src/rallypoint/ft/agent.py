"""The agent's side of "told, not timed out": a dead worker's group leaves the quorum now.

``Manager`` writes its lighthouse and member id into the file that ``rallypoint run``
names in ``RALLYPOINT_FT_NOTICE`` (one per worker). When the worker dies, the process that
reaps it calls :func:`tell_gone` in a child of its own (which imports nothing: this module
loads what it needs): the lighthouse reads the notice at once, tells the other groups'
watchers, which abort their collectives with the dead group, and leaves it out of the
next quorum, instead of waiting for its heartbeat to time out.
"""

from __future__ import annotations

import json
from datetime import timedelta

from rallypoint.ft._group.manager_parts import group_store
from rallypoint.ft._group.stopped import mark
from rallypoint.ft._quorum.client import post
from rallypoint.ft._quorum.records import Ask
from rallypoint.rendezvous import connect_kv

__all__ = ["tell_gone", "tell_stopped"]


def tell_gone(record: str, why: str, timeout: float = 5.0) -> bool:
    """Tell the lighthouse named in ``record`` (what the worker wrote) that its member left."""
    try:
        data = json.loads(record)
        lighthouse, member = str(data["lighthouse"]), str(data["member"])
    except (ValueError, KeyError, TypeError):
        return False  # not a replica group's record
    kv, _ = connect_kv(lighthouse, timeout=timedelta(seconds=timeout))
    post(kv, Ask("gone", member, why=why[:200]))
    return True


def tell_stopped(record: str, rank: int, stopped: bool, timeout: float = 5.0) -> bool:
    """Mark the worker's rank stopped or running in its group's store (named in ``record``),
    before a stop is told to the lighthouse: its group's rank 0 then neither beats nor asks
    until the rank runs again (``rallypoint.ft._group.stopped``). ``False``: the record
    names no group store (a worker of an older manager)."""
    try:
        host, port = json.loads(record)["group_store"]
        where = (str(host), int(port))
    except (ValueError, KeyError, TypeError):
        return False
    mark(group_store(*where, timedelta(seconds=timeout)), rank, stopped)
    return True
