"""torchft's ``torchft.coordination``: the lighthouse protocol's low-level API.

``LighthouseServer`` decides each round's quorum; ``LighthouseClient.quorum`` asks for one
and returns when a quorum holding the caller is decided; ``heartbeat`` keeps a replica
alive between asks. ``Manager`` speaks the same protocol through the same link
(``_client.LighthouseLink``). A program written against ``torchft.coordination`` runs
with the import swapped. The protocol and its store keys: docs/ft.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta

from rallypoint.ft._quorum.client import LighthouseLink
from rallypoint.ft._quorum.records import Quorum as _Decided
from rallypoint.ft._quorum.records import Request
from rallypoint.ft.lighthouse import LighthouseServer

__all__ = ["LighthouseClient", "LighthouseServer", "Quorum", "QuorumMember", "Timestamp"]


@dataclass
class QuorumMember:
    """One replica in a quorum, as it asked.

    Args:
        replica_id: the replica's id (unique among the live replicas).
        address: where its manager is reached (free text for the caller's use).
        store_address: its store (free text for the caller's use).
        step: the step it asked at.
        world_size: its number of ranks.
        shrink_only: whether it asked for a quorum that only shrinks.
        data: its own data, as it passed it (JSON-shaped).
    """

    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: dict[Hashable, object] | None = None


@dataclass
class Timestamp:
    """When a quorum was made.

    Args:
        seconds: whole seconds since the epoch.
        nanos: the nanoseconds past them.
    """

    seconds: int
    nanos: int


@dataclass
class Quorum:
    """A decided quorum.

    Args:
        quorum_id: changes only when its members do (or after a failed commit).
        participants: its members, sorted by replica id.
        created: when the lighthouse made it.
    """

    quorum_id: int
    participants: list[QuorumMember]
    created: Timestamp


class LighthouseClient:
    """A client of the lighthouse, for any number of replicas in this process.

    Args:
        addr: the lighthouse's address (``http://host:port``, ``host:port`` or
            ``etcd://host:port,...``).
        connect_timeout: how long a first connect may take.
    """

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        if not isinstance(connect_timeout, timedelta):
            raise TypeError(f"connect_timeout must be a timedelta, got {connect_timeout!r}")
        self.addr, self.connect_timeout = addr, connect_timeout
        self._links: dict[str, LighthouseLink] = {}
        self._lock = threading.Lock()
        self._made: dict[tuple[str, int], Quorum] = {}
        self._link("")  # a bad or unreachable address: one line, now

    def _link(self, replica_id: str) -> LighthouseLink:
        with self._lock:
            link = self._links.get(replica_id)
            if link is None:
                link = LighthouseLink(
                    self.addr,
                    replica_id or "(probe)",
                    replica_id,
                    connect_timeout=self.connect_timeout.total_seconds(),
                    heartbeat=None,
                    hello=bool(replica_id),
                )
                self._links[replica_id] = link
            return link

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict[Hashable, object] | None = None,
    ) -> Quorum:
        """Ask for a quorum as ``replica_id``; return one that holds it.

        Args:
            replica_id: who asks (an ask also counts as its heartbeat).
            timeout: how long to wait (``TimeoutError`` after).
            address, store_address, step, world_size, shrink_only, data: what the other
                replicas see of this one (:class:`QuorumMember`).
        """
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")
        if data is not None:
            try:
                data = json.loads(json.dumps(data))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"data must be JSON-shaped (str keys): {exc}") from None
        req = Request(
            member=replica_id,
            replica_id=replica_id,
            step=int(step or 0),
            world_size=int(world_size or 1),
            shrink_only=bool(shrink_only),
            address=address or "",
            store_address=store_address or "",
            data=data,  # type: ignore[arg-type]
        )
        decided = self._link(replica_id).quorum(req, timeout.total_seconds())
        with self._lock:
            made = self._made.get((decided.gen, decided.round))
            if made is None:
                made = _public(decided)
                self._made = {(decided.gen, decided.round): made}  # replicas of this
                # process read the same round: its members are made once
        return Quorum(made.quorum_id, list(made.participants), made.created)

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Say that ``replica_id`` is alive.

        Args:
            replica_id: the replica.
            timeout: accepted for torchft's signature (a beat is one store operation).
        """
        self._link(replica_id).beat()

    def close(self) -> None:
        """Stop: nothing of this client keeps running."""
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()


def _public(decided: _Decided) -> Quorum:
    seconds = int(decided.created)
    members = [
        QuorumMember(
            m.replica_id if m.member == m.replica_id else m.member,
            m.address,
            m.store_address,
            m.step,
            m.world_size,
            m.shrink_only,
            m.data,  # type: ignore[arg-type]
        )
        for m in decided.members
    ]
    return Quorum(
        decided.quorum_id, members, Timestamp(seconds, int((decided.created - seconds) * 1e9))
    )
