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
from rallypoint.ft._quorum.records import INT_BOUND, MAX_DATA, MAX_NAME, Request
from rallypoint.ft._quorum.records import Quorum as _Decided
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
        _timedelta("connect_timeout", connect_timeout)
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
        req = _request(replica_id, address, store_address, step, world_size, shrink_only, data)
        _timedelta("timeout", timeout)
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
        _replica_id(replica_id)
        _timedelta("timeout", timeout)
        self._link(replica_id).beat()

    def close(self) -> None:
        """Stop: nothing of this client keeps running."""
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()


def _request(
    replica_id: object,
    address: object,
    store_address: object,
    step: object,
    world_size: object,
    shrink_only: object,
    data: object,
) -> Request:
    """What a member asks with, each argument checked as torchft's are (a wrong type is a
    ``TypeError`` naming it, a number out of range an ``OverflowError``), and against what
    the lighthouse's records hold (a name of at most 256 characters, JSON-shaped data), so
    that no ask is refused by the lighthouse and left to time out."""
    _replica_id(replica_id)
    texts = {"address": address, "store_address": store_address}
    for name, text in texts.items():
        if text is not None and not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {text!r}")
        if isinstance(text, str) and len(text) > MAX_NAME:
            raise ValueError(f"{name} is {len(text)} characters long; at most {MAX_NAME}")
    if shrink_only is not None and not isinstance(shrink_only, bool):
        raise TypeError(f"shrink_only must be a bool, got {shrink_only!r}")
    if data is not None:
        if not isinstance(data, dict):
            raise TypeError(f"data must be a dict, got {type(data).__name__}")
        try:
            text = json.dumps(data)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"data must be JSON-shaped (str keys): {exc}") from None
        if len(text) > MAX_DATA:
            raise ValueError(f"data takes {len(text)} bytes as JSON; at most {MAX_DATA}")
        data = json.loads(text)
    return Request(
        member=str(replica_id),
        replica_id=str(replica_id),
        step=_integer("step", step, -INT_BOUND + 1),
        world_size=_integer("world_size", world_size, 0),
        shrink_only=bool(shrink_only),
        address=str(address or ""),
        store_address=str(store_address or ""),
        data=data,  # type: ignore[arg-type]
    )


def _replica_id(replica_id: object) -> None:
    if not isinstance(replica_id, str):
        raise TypeError(f"replica_id must be a str, got {replica_id!r}")
    if not replica_id or len(replica_id) > MAX_NAME:
        raise ValueError(
            f"replica_id must be a string of 1 to {MAX_NAME} characters, got {replica_id[:40]!r}"
            + ("..." if len(replica_id) > 40 else "")
        )


def _integer(name: str, value: object, least: int) -> int:
    """``value`` (``None``: 0, torchft's default) as an integer from ``least`` up."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not least <= value < INT_BOUND:
        raise OverflowError(f"{name} is {value}; it must be from {least} to {INT_BOUND - 1}")
    return value


def _timedelta(name: str, value: object) -> None:
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a timedelta, got {value!r}")


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
