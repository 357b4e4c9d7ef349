"""The round protocol's data: key layout, node descriptors, the final record, ranks, and
what a node's heartbeat thread watches (``Watch``).

Everything of run ``R`` lives under ``rallypoint/rdzv/R/``; :class:`Keys` lists the keys
and what each holds. Finalising round k deletes the slot, rank and member keys of round
k-2 in the background.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rallypoint.rendezvous._api import RendezvousStateError

CLOSED = b'{"closed":true}'
LEFT = b'{"left":true}'


def _corrupt(where: str, raw: bytes) -> RendezvousStateError:
    return RendezvousStateError(f"The rendezvous key {where} is corrupt: {raw[:80]!r}")


class Keys:
    """Key names of one run, under ``rallypoint/rdzv/R/``:

    ::

        closed                 exists once the run is closed
        latest                 hint: the newest opened round (readers scan forward from it)
        hb/<node>              a node's heartbeat counter (add 1 per interval)
        r<k>/open              round k accepts joins (round 0 always does); "closed" if closed
        r<k>/joined            arrival counter: add(1) gives a node its slot index
        r<k>/slot/<i>          descriptor of the node in slot i (JSON)
        r<k>/claim             set-if-absent: the one node that finalises round k
        r<k>/rank/<i>          rank of slot i (-1: not admitted), written before final
        r<k>/member/<rank>     node id of each rank (heartbeat ring)
        r<k>/final             the round's record (JSON); its appearance wakes every waiter
        r<k>/late              nodes that arrived after round k was final (waiting or spare)
        r<k>/dead              members presumed dead by missed heartbeats (+ dead/<node>)
        r<k>/store/...         the round's store for agents and workers
    """

    __slots__ = ("prefix",)

    def __init__(self, run_id: str) -> None:
        self.prefix = f"rallypoint/rdzv/{run_id}/"

    @property
    def closed(self) -> str:
        return self.prefix + "closed"

    @property
    def latest(self) -> str:
        return self.prefix + "latest"

    def hb(self, node: str) -> str:
        return f"{self.prefix}hb/{node}"

    def r(self, k: int, name: str) -> str:
        return f"{self.prefix}r{k}/{name}"

    def store(self, k: int) -> str:
        return f"{self.prefix}r{k}/store"


@dataclass(frozen=True, slots=True)
class Slot:
    """A node's descriptor in one round."""

    index: int
    node: str
    addr: str
    prev_round: int | None
    prev_rank: int | None

    def encode(self) -> bytes:
        prev = None if self.prev_round is None else [self.prev_round, self.prev_rank]
        return json.dumps({"id": self.node, "addr": self.addr, "prev": prev}).encode()

    @staticmethod
    def decode(index: int, raw: bytes, where: str) -> Slot | None:
        """Parse a slot; ``None`` for a node that left; RendezvousStateError for garbage."""
        data = parse_json(raw, where)
        if data.get("left"):
            return None
        try:
            prev = data["prev"]
            return Slot(
                index=index,
                node=str(data["id"]),
                addr=str(data["addr"]),
                prev_round=None if prev is None else int(prev[0]),
                prev_rank=None if prev is None else int(prev[1]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise _corrupt(where, raw) from exc


@dataclass(frozen=True, slots=True)
class Final:
    """The record that completes a round."""

    closed: bool = False
    corrupt: str = ""
    n: int = 0
    world_size: int = 0

    def encode(self) -> bytes:
        return json.dumps({"n": self.n, "world_size": self.world_size}).encode()

    @staticmethod
    def decode(raw: bytes, where: str) -> Final:
        data = parse_json(raw, where)
        if data.get("closed"):
            return Final(closed=True)
        if "corrupt" in data:
            return Final(corrupt=str(data["corrupt"]))
        try:
            return Final(n=int(data["n"]), world_size=int(data["world_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(where, raw) from exc


def corrupt_record(reason: str) -> bytes:
    return json.dumps({"corrupt": reason}).encode()


def parse_json(raw: bytes, where: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(where, raw) from exc
    if not isinstance(data, dict):
        raise _corrupt(where, raw)
    return data


def parse_int(raw: bytes | None, where: str, default: int = 0) -> int:
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise RendezvousStateError(
            f"The rendezvous key {where} is corrupt: expected an integer, got {raw[:80]!r}"
        ) from exc


def assign_ranks(slots: list[Slot], round_: int, max_nodes: int) -> dict[int, int]:
    """Choose the members of ``round_`` and give each a rank: slot index -> rank.

    Members of the previous round come first (in their old rank order), then new nodes
    by arrival; at most ``max_nodes`` are admitted. A survivor keeps its old rank when
    it is below the new world size (so rank 0, which hosts the workers' store, stays
    put); the others fill the free ranks in the same order. Pure and deterministic.
    """
    previous = sorted(
        (s for s in slots if s.prev_round == round_ - 1 and s.prev_rank is not None),
        key=lambda s: (s.prev_rank, s.index),
    )
    seen = {s.index for s in previous}
    newcomers = [s for s in sorted(slots, key=lambda s: s.index) if s.index not in seen]
    chosen = (previous + newcomers)[:max_nodes]
    world = len(chosen)
    ranks: dict[int, int] = {}
    taken: set[int] = set()
    for s in chosen:
        rank = s.prev_rank
        if s.index in seen and rank is not None and rank < world and rank not in taken:
            ranks[s.index] = rank
            taken.add(rank)
    free = iter(r for r in range(world) if r not in taken)
    for s in chosen:
        if s.index not in ranks:
            ranks[s.index] = next(free)
    return ranks


@dataclass(slots=True)
class Watch:
    """What the heartbeat thread watches: neighbours' counters and when they last moved,
    and when this node last read them (``read_at``)."""

    round: int
    neighbours: list[str] = field(default_factory=list)
    seen: dict[str, tuple[bytes | None, float]] = field(default_factory=dict)
    marked: set[str] = field(default_factory=set)
    read_at: float | None = None

    def forgive(self, blind: float) -> None:
        """This node could not read the store for ``blind`` seconds (the store was away:
        an etcd election, a member lost): its neighbours' beats could not land either, so
        that time does not count towards their silence."""
        self.seen = {node: (value, since + blind) for node, (value, since) in self.seen.items()}
