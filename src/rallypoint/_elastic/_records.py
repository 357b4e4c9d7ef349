"""What the agents of a job write into the store for each other: typed records as JSON.

- :class:`NodeRecord` (``node/<group rank>``): a node's local world size and host;
- :class:`FailureRecord` (``failure/<group rank>``): a node's first worker failure;
- :class:`Decision` (``restart``): the round's fate, decided once for the whole job;
- :class:`RootRecord` (``root``): the job's root cause, the earliest failure, if any;
- :class:`ExclusionRecord` (``excluded``, a JSON list in the run store): an agent kept out.

Each has ``to_json()`` and ``from_json()``; a malformed record raises
``RendezvousStateError`` naming the key, since every agent of a job runs the same code.
The exclusion list is the exception: any store client can write it, and a malformed record
in it is reported and ignored (``ExclusionRecord.list_from_json``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from rallypoint._core.status import WorkerStatus
from rallypoint._supervise._errors import WorkerSummary
from rallypoint.rendezvous import RendezvousStateError

__all__ = [
    "MAX_UNIX_TIME",
    "Action",
    "Decision",
    "ExclusionRecord",
    "FailureRecord",
    "NodeRecord",
    "RootRecord",
]


def _load(data: str | bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RendezvousStateError(f"the store holds a malformed {what} record: {exc}") from None


def _fields(obj: Any, what: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict) or not set(names) <= set(obj):
        raise RendezvousStateError(f"the store holds a malformed {what} record: {obj!r}")
    return {name: obj[name] for name in names}


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One node of a round: how many workers it runs and on which host."""

    nproc: int
    host: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> NodeRecord:
        f = _fields(_load(data, "node"), "node", ("nproc", "host"))
        return cls(nproc=int(f["nproc"]), host=str(f["host"]))


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """A node's first worker failure of a round, with what it left behind."""

    time: float
    """Unix time of the worker's exit (the earliest is the job's root cause)."""
    elapsed: float
    """Seconds from that node's start to the exit."""
    host: str
    group_rank: int
    rank: int
    local_rank: int
    pid: int
    exitcode: int | None
    detail: str
    traceback: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> FailureRecord:
        names = tuple(cls.__dataclass_fields__)
        return cls(**_fields(_load(data, "failure"), "failure", names))

    def worker_state(self) -> WorkerSummary:
        return WorkerSummary(
            self.rank, self.local_rank, self.pid, WorkerStatus.FAILED, self.exitcode, self.detail
        )


MAX_UNIX_TIME = 253402300799.0
"""The last second of the year 9999: an exclusion's time must be a Unix time up to it."""


@dataclass(frozen=True, slots=True)
class ExclusionRecord:
    """An agent kept out of the job for good: it was the root cause of failures in a row,
    or the burn-in found it slow. The other agents on its host stay."""

    node: str
    """The agent's identity in the rendezvous (``RendezvousHandler.node_id``)."""
    host: str
    """The host it ran on (several agents may share one)."""
    reason: str
    time: float
    """Unix time of the exclusion."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> ExclusionRecord:
        try:
            return cls._from_obj(_load(data, "exclusion"))
        except ValueError as exc:
            raise RendezvousStateError(
                f"the store holds a malformed exclusion record: {exc}"
            ) from None

    @classmethod
    def _from_obj(cls, obj: Any) -> ExclusionRecord:
        """One record; ``ValueError`` saying which field is wrong."""
        names = tuple(cls.__dataclass_fields__)
        if not isinstance(obj, dict) or not set(names) <= set(obj):
            raise ValueError(f"it needs {', '.join(names)}; got {obj!r:.80}")
        for name in ("node", "host", "reason"):
            if not isinstance(obj[name], str):
                raise ValueError(f"{name!r} must be a string, got {obj[name]!r:.80}")
        when = obj["time"]
        if (
            isinstance(when, bool)
            or not isinstance(when, int | float)
            or not 0 <= when <= MAX_UNIX_TIME  # NaN fails it too
        ):
            raise ValueError(f"'time' must be a Unix time, got {when!r:.80}")
        return cls(node=obj["node"], host=obj["host"], reason=obj["reason"], time=float(when))

    @staticmethod
    def list_to_json(records: list[ExclusionRecord]) -> str:
        return json.dumps([asdict(r) for r in records])

    @classmethod
    def list_from_json(cls, data: str | bytes, key: str) -> tuple[list[ExclusionRecord], list[str]]:
        """The records of the exclusion list stored under ``key``, and for each item that is
        not a valid record a line that names the key and says what is wrong (the item is
        to be ignored). ``RendezvousStateError`` naming the key if the list itself is
        malformed."""
        items = cls._items(data, key)
        records: list[ExclusionRecord] = []
        bad: list[str] = []
        for i, item in enumerate(items):
            try:
                records.append(cls._from_obj(item))
            except ValueError as exc:
                bad.append(f"the key {key!r} holds a malformed exclusion record (item {i}): {exc}")
        return records, bad

    @classmethod
    def list_plus(cls, data: str | bytes, key: str, record: ExclusionRecord) -> str:
        """The exclusion list stored under ``key`` (``""``: none) with ``record`` added;
        every item already there is kept as it is, a malformed one too."""
        items = cls._items(data, key) if data else []
        return json.dumps([*items, asdict(record)])

    @staticmethod
    def _items(data: str | bytes, key: str) -> list[Any]:
        try:
            items = json.loads(data)
            if not isinstance(items, list):
                raise ValueError(f"not a list: {items!r:.80}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RendezvousStateError(
                f"the key {key!r} holds a malformed exclusion list ({exc})"
            ) from None
        return items


class Action(enum.Enum):
    """What every node does after a round that did not succeed."""

    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Decision:
    """The round's fate, written once by the node that claimed it."""

    action: Action
    reason: str
    count: int
    """Restarts of the job's budget spent, this one included."""
    by: int
    """Group rank of the node that decided."""
    note: str = ""
    """Why a failure is not restarted although budget is left, or why a node is excluded
    (said on every node)."""
    excluded: str = ""
    """The node this decision excludes from the job (it leaves; the others restart)."""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "action": self.action.value})

    @classmethod
    def from_json(cls, data: str | bytes) -> Decision:
        obj = _load(data, "decision")
        f = _fields(obj, "decision", ("action", "reason", "count", "by"))
        try:
            action = Action(f["action"])
        except ValueError:
            raise RendezvousStateError(
                f"the store holds an unknown action {f['action']!r}"
            ) from None
        return cls(
            action=action,
            reason=str(f["reason"]),
            count=int(f["count"]),
            by=int(f["by"]),
            note=str(obj.get("note", "")),
            excluded=str(obj.get("excluded", "")),
        )


@dataclass(frozen=True, slots=True)
class RootRecord:
    """The job's root cause: the earliest failure record, or ``None`` (a hang, a timeout)."""

    failure: FailureRecord | None

    def to_json(self) -> str:
        return "null" if self.failure is None else self.failure.to_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> RootRecord:
        if _load(data, "root") is None:
            return cls(None)
        return cls(FailureRecord.from_json(data))
