"""The records of the quorum protocol, and their validation.

Everything read from the lighthouse's store is input: anyone who can reach a TCPStore's
port can write any key. Each record here is parsed by ``from_bytes(raw, key)``, which
checks every field's type and size and raises :class:`RecordError` naming the key and what
is wrong; the reader says that in one line and goes on without the record. The keys and
who writes them: docs/ft.md ("The protocol").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "INT_BOUND",
    "MAX_DATA",
    "MAX_NAME",
    "MAX_RECORD",
    "NEWS_KEPT",
    "Ask",
    "Quorum",
    "RecordError",
    "Request",
    "RoundNote",
    "Rules",
    "changes",
    "parse_answer",
    "parse_counter",
    "parse_message",
]

MAX_RECORD = 4 << 20
"""Bytes: no record of the protocol is larger (a quorum of 1,000 groups is ~300 KB)."""
MAX_NAME = 256
"""Characters: the longest name (member, replica id, address) a record may hold."""
MAX_DATA = 64 << 10
"""Bytes: the most a member's own data may take, as JSON."""
_MAX_RANKS = 1 << 16

NEWS_KEPT = 8
"""The lighthouse keeps its last this many ``news/<k>``; a watcher back from an absence
reads those it missed."""


class RecordError(ValueError):
    """A record in the store that is not what the protocol writes (names the key)."""


class RoundNote(RecordError):
    """A round that is not a quorum but a note of why not (``r/<n>`` = ``{"note": ...}``)."""


def _load(raw: bytes, key: str) -> dict[str, Any]:
    if len(raw) > MAX_RECORD:
        raise RecordError(f"{key}: {len(raw)} bytes, more than any record of the protocol")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RecordError(f"{key}: not JSON ({raw[:40]!r})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{key}: a {type(data).__name__}, not an object")
    return data


_ABSENT = object()
INT_BOUND = 1 << 62
"""Every integer of a record is below this (and a step above its negative)."""


def _get(data: Mapping[str, Any], name: str, kind: type, key: str, default: Any = ...) -> Any:
    # the common case first: a value of exactly the type asked for, within bounds (a round
    # of G members is G requests of 11 fields, read by every process that hosts members)
    value = data.get(name, _ABSENT)
    kind_of = type(value)
    if kind_of is kind:
        if kind_of is str:
            if len(value) <= MAX_NAME:
                return value
        elif kind_of is int:
            if 0 <= value < INT_BOUND:
                return value
        else:
            return value
    elif value is _ABSENT and default is not ...:
        return default
    return _checked(data, name, kind, key, default)


def _checked(data: Mapping[str, Any], name: str, kind: type, key: str, default: Any) -> Any:
    """``_get`` for the rest: a default, or one line naming the key and what is wrong."""
    if name not in data:
        if default is ...:
            raise RecordError(f"{key}: no {name!r}")
        return default
    value: Any = data[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RecordError(f"{key}: {name!r} is {value!r}, not an integer")
    if not isinstance(value, kind):
        raise RecordError(f"{key}: {name!r} is {value!r}, not a {kind.__name__}")
    if isinstance(value, str) and len(value) > MAX_NAME:
        raise RecordError(f"{key}: {name!r} is {len(value)} characters long")
    if isinstance(value, int) and not 0 <= value < INT_BOUND:
        raise RecordError(f"{key}: {name!r} is {value}, out of range")
    return value


def _step(data: Mapping[str, Any], key: str) -> int:
    """A step: signed, within ``INT_BOUND`` either way (torchft's are ``i64``; nothing here
    steps back past 0, but a coordination client may say any)."""
    value = data.get("step")
    if type(value) is int and -INT_BOUND < value < 0:
        return value
    return int(_get(data, "step", int, key))


def _names(data: Mapping[str, Any], name: str, key: str) -> tuple[str, ...]:
    value = _get(data, name, list, key, [])
    if len(value) > _MAX_RANKS or not all(isinstance(v, str) and len(v) <= MAX_NAME for v in value):
        raise RecordError(f"{key}: {name!r} is not a list of short strings")
    return tuple(value)


def parse_counter(raw: bytes | None, key: str) -> int:
    """A counter the protocol keeps with ``add`` (0 if missing)."""
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise RecordError(f"{key}: {raw[:40]!r}, not a counter") from None
    if value < 0:
        raise RecordError(f"{key}: {value}, a negative counter")
    return value


@dataclass(frozen=True, slots=True)
class Rules:
    """The lighthouse's rules, as torchft's flags name them (milliseconds)."""

    min_replicas: int = 1
    join_timeout_ms: int = 60000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, key: str = "config") -> Rules:
        data = _load(raw, key)
        values = {n: _get(data, n, int, key, getattr(cls(), n)) for n in cls.__dataclass_fields__}
        if values["min_replicas"] < 1 or values["heartbeat_timeout_ms"] < 1:
            raise RecordError(f"{key}: min_replicas and heartbeat_timeout_ms must be >= 1")
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Request:
    """What a member asks with, and how it appears in a quorum."""

    member: str
    """Unique per process life: ``<replica id>:<token>`` for a manager."""
    replica_id: str
    step: int
    world_size: int
    heal: tuple[str, ...] = ()
    """Its ranks' heal servers, by group rank (where a lagging group fetches state)."""
    commit_failures: int = 0
    shrink_only: bool = False
    secret: str = ""
    """The key its heal servers accept (hex; empty when ``RALLYPOINT_FT_SECRET`` is set)."""
    address: str = ""
    store_address: str = ""
    data: dict[str, Any] | None = None
    """A coordination client's own data (torchft's ``QuorumMember.data``)."""

    def to_json(self) -> dict[str, Any]:
        # fields read as they are (asdict deep-copies each: a round of G members is G of
        # them), those at their defaults left out
        out: dict[str, Any] = {
            "member": self.member,
            "replica_id": self.replica_id,
            "step": self.step,
            "world_size": self.world_size,
        }
        if self.heal:
            out["heal"] = list(self.heal)
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value not in ("", None, False, 0):  # (an empty dict of data is kept)
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: Any, key: str) -> Request:
        if not isinstance(data, dict):
            raise RecordError(f"{key}: a member is a {type(data).__name__}, not an object")
        extra = _get(data, "data", dict, key, None)
        if extra is not None and len(json.dumps(extra)) > MAX_DATA:
            raise RecordError(f"{key}: a member's data is larger than 64 KiB")
        req = cls(
            member=_get(data, "member", str, key),
            replica_id=_get(data, "replica_id", str, key),
            step=_step(data, key),
            world_size=_get(data, "world_size", int, key),
            heal=_names(data, "heal", key),
            commit_failures=_get(data, "commit_failures", int, key, 0),
            shrink_only=_get(data, "shrink_only", bool, key, False),
            secret=_get(data, "secret", str, key, ""),
            address=_get(data, "address", str, key, ""),
            store_address=_get(data, "store_address", str, key, ""),
            data=extra,
        )
        if not req.member:
            raise RecordError(f"{key}: a member needs a name")
        return req


_OPTIONAL = ("commit_failures", "shrink_only", "secret", "address", "store_address", "data")
"""The fields of a :class:`Request` written only when they are not at their defaults."""


@dataclass(frozen=True, slots=True)
class Quorum:
    """A decided quorum: its id (it changes only when its members do, or after a failed
    commit), the lighthouse life it belongs to, its round, its members sorted by replica
    id, and why each member of the quorum before it that is not in it left."""

    quorum_id: int
    gen: str
    members: tuple[Request, ...]
    round: int = 0
    left: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    _held: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_held", frozenset(m.member for m in self.members))

    def ids(self) -> list[str]:
        return [m.member for m in self.members]

    def holds(self, member: str) -> bool:
        """Whether ``member`` is in this quorum (each member of a process that hosts many
        asks this of the same round)."""
        return member in self._held

    def to_bytes(self) -> bytes:
        body = {
            "quorum_id": self.quorum_id,
            "gen": self.gen,
            "round": self.round,
            "members": [m.to_json() for m in self.members],
            "left": self.left,
            "created": self.created,
        }
        return json.dumps(body).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, key: str) -> Quorum:
        data = _load(raw, key)
        if set(data) == {"note"} and isinstance(data["note"], str):
            raise RoundNote(data["note"][:MAX_NAME])
        members = _get(data, "members", list, key)
        if not members or len(members) > _MAX_RANKS:
            raise RecordError(f"{key}: a quorum of {len(members)} members")
        left = _get(data, "left", dict, key, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in left.items()):
            raise RecordError(f"{key}: 'left' is not member -> why")
        created = data.get("created", 0.0)
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise RecordError(f"{key}: 'created' is {created!r}, not a time")
        return cls(
            _get(data, "quorum_id", int, key),
            _get(data, "gen", str, key),
            tuple(Request.from_json(m, key) for m in members),
            _get(data, "round", int, key),
            dict(left),
            float(created),
        )


@dataclass(frozen=True, slots=True)
class Ask:
    """A member's message to the lighthouse: ``hello`` (it exists), ``ask`` (a quorum,
    answered under ``a/<member>/<seq>``), ``gone`` (it left, told by itself or its agent),
    ``abort`` (it voted a round's commit down) or ``tick`` (the lighthouse's own clock)."""

    kind: str
    member: str = ""
    seq: int = 0
    request: Request | None = None
    why: str = ""
    round: int = 0
    prev: tuple[int, tuple[str, ...]] | None = None
    """``(quorum id, members)`` of the last quorum it had under another lighthouse life."""
    replica_id: str = ""
    """A ``hello``'s replica id (its requests carry their own)."""
    retry_of: int = 0
    """An ask that repeats ask ``retry_of`` (its answer was unreadable): the same round."""
    after: int | None = None
    """The round a member of its quorum asks after: it waits on ``r/<after + 1>``."""
    again: bool = False
    """Posted again by a member that was stopped while it waited (its heartbeat found the
    gap): a lighthouse that answered it already ignores it."""

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"kind": self.kind}
        if self.member:
            body["member"] = self.member
        if self.kind == "ask":
            body["seq"] = self.seq
        if self.request is not None:
            body["request"] = self.request.to_json()
        if self.why:
            body["why"] = self.why
        if self.kind == "abort":
            body["round"] = self.round
        if self.replica_id:
            body["replica_id"] = self.replica_id
        if self.retry_of:
            body["retry_of"] = self.retry_of
        if self.prev is not None:
            body["prev"] = {"quorum_id": self.prev[0], "members": list(self.prev[1])}
        if self.after is not None:
            body["after"] = self.after
        if self.again:
            body["again"] = True
        return json.dumps(body).encode()


_KINDS = ("hello", "ask", "gone", "abort", "tick", "hole")


def parse_message(raw: bytes, key: str) -> Ask:
    """An inbox message (:class:`Ask`), validated."""
    data = _load(raw, key)
    kind = _get(data, "kind", str, key)
    if kind not in _KINDS:
        raise RecordError(f"{key}: unknown kind {kind!r}")
    if kind in ("tick", "hole"):
        return Ask(kind)
    member = _get(data, "member", str, key)
    request = None
    if "request" in data:
        request = Request.from_json(data["request"], key)
        if request.member != member:
            raise RecordError(f"{key}: asks for {request.member!r} as {member!r}")
    if kind == "ask" and request is None:
        raise RecordError(f"{key}: an ask without its request")
    prev = None
    if "prev" in data:
        raw_prev = _get(data, "prev", dict, key)
        prev = (_get(raw_prev, "quorum_id", int, key), _names(raw_prev, "members", key))
    return Ask(
        kind,
        member,
        _get(data, "seq", int, key, 0),
        request,
        _get(data, "why", str, key, ""),
        _get(data, "round", int, key, 0),
        prev,
        _get(data, "replica_id", str, key, ""),
        _get(data, "retry_of", int, key, 0),
        _get(data, "after", int, key, None),
        _get(data, "again", bool, key, False),
    )


def parse_answer(raw: bytes, key: str) -> tuple[str, int | str]:
    """An answer to an ask: ``("round", n)``, ``("retry", why)`` or ``("refused", why)``."""
    data = _load(raw, key)
    if "round" in data:
        return "round", _get(data, "round", int, key)
    for kind in ("retry", "refused"):
        if kind in data:
            return kind, str(_get(data, kind, str, key))[:MAX_NAME]
    raise RecordError(f"{key}: not an answer ({raw[:40]!r})")


def answer(kind: str, value: int | str) -> bytes:
    return json.dumps({kind: value}).encode()


def sort_members(requests: Sequence[Request]) -> tuple[Request, ...]:
    return tuple(sorted(requests, key=lambda r: (r.replica_id, r.member)))


def changes(
    quorum: Quorum, previous: Quorum | None
) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """``(left, joined)`` since ``previous``: ``(replica id, why)`` of each group that left,
    ``(replica id, step)`` of each that joined (none for the first quorum)."""
    if previous is None:
        return [], []
    now = {m.member for m in quorum.members}
    before = {m.member for m in previous.members}
    left = [
        (m.replica_id, quorum.left.get(m.member, "no heartbeat, or it did not ask in time"))
        for m in previous.members
        if m.member not in now
    ]
    joined = [(m.replica_id, m.step) for m in quorum.members if m.member not in before]
    return left, joined
