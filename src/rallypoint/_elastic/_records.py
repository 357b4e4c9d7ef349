"""What the agents of a job write into the store for each other: typed records as JSON.

- :class:`NodeRecord` (``node/<group rank>``): a node's local world size and host;
- :class:`FailureRecord` (``failure/<group rank>``): a node's first worker failure;
- :class:`Decision` (``restart``): the round's fate, decided once for the whole job;
- :class:`RootRecord` (``root``): the job's root cause, the earliest failure, if any;
- :class:`ExclusionRecord` (``excluded``, a JSON list in the run store): an agent kept out.

Each has ``to_json()`` and ``from_json()``; a malformed record raises
``RendezvousStateError`` naming the key, since every agent of a job runs the same code.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from rallypoint._core.status import WorkerStatus
from rallypoint._supervise._errors import WorkerSummary
from rallypoint.rendezvous import RendezvousStateError

__all__ = ["Action", "Decision", "FailureRecord", "NodeRecord", "RootRecord"]


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
        f = _fields(_load(data, "exclusion"), "exclusion", tuple(cls.__dataclass_fields__))
        return cls(
            node=str(f["node"]), host=str(f["host"]), reason=str(f["reason"]), time=float(f["time"])
        )

    @staticmethod
    def list_to_json(records: list[ExclusionRecord]) -> str:
        return json.dumps([asdict(r) for r in records])

    @classmethod
    def list_from_json(cls, data: str | bytes, key: str) -> list[ExclusionRecord]:
        """The records of the exclusion list stored under ``key`` (named when malformed)."""
        try:
            items = json.loads(data)
            if not isinstance(items, list):
                raise ValueError(f"not a list: {items!r:.80}")
            return [cls.from_json(json.dumps(item)) for item in items]
        except (ValueError, UnicodeDecodeError, RendezvousStateError) as exc:
            raise RendezvousStateError(
                f"the key {key!r} holds a malformed exclusion list ({exc})"
            ) from None


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
