"""One node's Flight Recorder arrivals as a run-store record, for the judging node.

Every node but the judge (group rank 0) writes what its workers answered to an arrivals
request (``_flight._recorder``: the entries of the straggler window, no frames) under
``arrivals/<round>/<group rank>``, only what the judge compares: per rank and group, the
group's members and each collective's number and arrival (``time_created_ns``, the node's
clock; ``_clock_offset`` says how the judge corrects it), and its time on the GPU where
NCCL measured one. About 25 bytes per collective, at most :data:`SHIP_LIMIT` per group and
rank (the newest).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace

__all__ = [
    "SHIP_LIMIT",
    "NodeArrivals",
    "arrivals_key",
    "arrivals_record",
    "read_arrivals_record",
]

SHIP_LIMIT = 512
"""The newest collectives per group and rank a record holds."""


@dataclass(frozen=True, slots=True)
class NodeArrivals:
    """One node's sample: its ``seq``-th (so a judge tells an old record from a new one),
    its host, and its ranks' traces."""

    seq: int
    host: str
    traces: Mapping[int, RankTrace]


def arrivals_key(round: int, group_rank: int) -> str:
    """The run-store key of node ``group_rank``'s arrivals in round ``round``."""
    return f"arrivals/{round}/{group_rank}"


def arrivals_record(sample: NodeArrivals) -> str:
    """The record of one sample."""
    ranks = {
        str(rank): [_group_record(g) for g in trace.groups]
        for rank, trace in sample.traces.items()
        if trace.error is None
    }
    record = {"seq": sample.seq, "host": sample.host, "ranks": ranks}
    return json.dumps(record, separators=(",", ":"))


def _group_record(group: GroupTrace) -> list[Any]:
    arrivals = [
        [e.seq, e.created_ns] if e.duration_ns is None else [e.seq, e.created_ns, e.duration_ns]
        for e in group.entries[-SHIP_LIMIT:]
    ]
    return [group.name, list(group.ranks), group.world, arrivals]


def _entry(arrival: list[Any]) -> FlightEntry:
    seq, created, *duration = arrival
    ns = int(duration[0]) if duration else None
    return FlightEntry(int(seq), "", (), (), int(created), False, duration_ns=ns)


def read_arrivals_record(raw: bytes | str) -> NodeArrivals:
    """A record's sample; ``ValueError`` if it is malformed."""
    try:
        obj: Any = json.loads(raw)
        traces = {}
        for rank, groups in obj["ranks"].items():
            traces[int(rank)] = RankTrace(
                int(rank),
                tuple(
                    GroupTrace(
                        str(name),
                        tuple(int(r) for r in members),
                        issued=max((int(e[0]) for e in entries), default=0),
                        completed=0,
                        entries=tuple(_entry(e) for e in entries),
                        world=bool(world),
                    )
                    for name, members, world, entries in groups
                ),
            )
        return NodeArrivals(int(obj["seq"]), str(obj["host"]), traces)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed arrivals record: {exc!r}") from None
