"""What one worker's Flight Recorder holds, as records that travel between processes.

torch's Flight Recorder (``torch._C._distributed_c10d._dump_fr_trace()``) keeps the last
``TORCH_FR_BUFFER_SIZE`` collectives of every process group of a worker, gloo's and NCCL's
alike. A worker's dumper (``_recorder``) turns its pickle into a :class:`RankTrace`: the
groups the worker belongs to (global ranks, which torch's gloo dump leaves empty), each
group's last issued and completed collective number, and the recent entries with the
Python frames that issued them. All of it is JSON-compatible, for the stacks exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FlightEntry", "GroupTrace", "RankTrace"]


@dataclass(frozen=True, slots=True)
class FlightEntry:
    """One recorded collective of one group on one rank.

    ``op`` is torch's profiling name without the backend (``all_reduce``); ``frames`` are
    ``(filename, lineno, name)``, innermost first, as torch records them when the
    collective is issued; ``created_ns`` is the wall clock (``time_ns``) at that moment;
    ``duration_ns`` how long the collective ran on this rank's GPU, from the moment its
    stream reached it to its end (NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``, once done).
    """

    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    created_ns: int
    completed: bool
    frames: tuple[tuple[str, int, str], ...] = ()
    duration_ns: int | None = None

    @property
    def signature(self) -> tuple[Any, ...]:
        """What every member must agree on: op, sizes and dtypes."""
        return (self.op, self.sizes, self.dtypes)

    def to_json(self) -> list[Any]:
        return [
            self.seq,
            self.op,
            [list(s) for s in self.sizes],
            list(self.dtypes),
            self.created_ns,
            self.completed,
            [list(f) for f in self.frames],
            self.duration_ns,
        ]

    @classmethod
    def from_json(cls, obj: Any) -> FlightEntry:
        seq, op, sizes, dtypes, created, completed, frames, *rest = obj
        duration = rest[0] if rest else None
        return cls(
            seq=int(seq),
            op=str(op),
            sizes=tuple(tuple(int(n) for n in s) for s in sizes),
            dtypes=tuple(str(d) for d in dtypes),
            created_ns=int(created),
            completed=bool(completed),
            frames=tuple((str(f), int(n), str(name)) for f, n, name in frames),
            duration_ns=None if duration is None else int(duration),
        )


@dataclass(frozen=True, slots=True)
class GroupTrace:
    """One process group as one member saw it.

    ``name`` is torch's group name (the same on every member); ``ranks`` its members as
    global ranks; ``issued``/``completed`` the last collective numbers this member issued
    and saw complete; ``entries`` the recent ones, oldest first.
    """

    name: str
    ranks: tuple[int, ...]
    issued: int
    completed: int
    entries: tuple[FlightEntry, ...] = ()
    world: bool = False

    def entry(self, seq: int) -> FlightEntry | None:
        return next((e for e in self.entries if e.seq == seq), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ranks": list(self.ranks),
            "issued": self.issued,
            "completed": self.completed,
            "world": self.world,
            "entries": [e.to_json() for e in self.entries],
        }

    @classmethod
    def from_json(cls, obj: Any) -> GroupTrace:
        return cls(
            name=str(obj["name"]),
            ranks=tuple(int(r) for r in obj["ranks"]),
            issued=int(obj["issued"]),
            completed=int(obj["completed"]),
            world=bool(obj["world"]),
            entries=tuple(FlightEntry.from_json(e) for e in obj["entries"]),
        )


@dataclass(frozen=True, slots=True)
class RankTrace:
    """One worker's Flight Recorder, or why there is none (``error``)."""

    rank: int
    groups: tuple[GroupTrace, ...] = ()
    error: str | None = None

    def group(self, name: str) -> GroupTrace | None:
        return next((g for g in self.groups if g.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "error": self.error,
            "groups": [g.to_json() for g in self.groups],
        }

    @classmethod
    def from_json(cls, obj: Any) -> RankTrace:
        """Rebuild a trace from :meth:`to_json`'s output; ``ValueError`` if malformed."""
        try:
            error = obj["error"]
            return cls(
                rank=int(obj["rank"]),
                error=None if error is None else str(error),
                groups=tuple(GroupTrace.from_json(g) for g in obj["groups"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed Flight Recorder record: {exc!r}") from None
