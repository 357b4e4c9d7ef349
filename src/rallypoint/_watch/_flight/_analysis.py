"""Which rank and which collective hang a job, from every rank's Flight Recorder.

:func:`analyse` finds, in each process group, the first collective that not all its
members completed, and sorts the members into those that never issued it, those that
issued something else there (a mismatch) and those that wait. It then follows the waits
across groups to the ranks that wait in no collective (a busy loop, a sleep, a dead data
loader): those are the root. Point-to-point operations are not analysed: their numbering
is per pair of ranks, not per group.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from rallypoint._watch._flight._records import FlightEntry, RankTrace

__all__ = ["Diagnosis", "GroupState", "RootCause", "RootKind", "analyse"]


class RootKind(enum.Enum):
    NEVER_ISSUED = "never issued"
    MISMATCH = "mismatch"
    NO_DATA = "no data"
    """A member of the stuck group sent no trace (a busy worker that did not answer in
    time, a dead one): the others wait in a collective that it may not have issued."""


@dataclass(frozen=True, slots=True)
class GroupState:
    """One group across its members: ``stuck_seq`` is 0 when nothing is pending."""

    name: str
    ranks: tuple[int, ...]
    world: bool
    done: int
    """The last collective number every member (with data) completed."""
    stuck_seq: int = 0
    issued: Mapping[int, FlightEntry | None] = field(default_factory=dict)
    """Who issued ``stuck_seq`` (``None``: issued, but the entry left the buffer)."""
    waiting: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    mismatched: tuple[int, ...] = ()
    expected: FlightEntry | None = None
    """The entry most members issued at ``stuck_seq``."""
    unknown: tuple[int, ...] = ()
    """Members without a trace."""

    @property
    def stuck(self) -> bool:
        return self.stuck_seq > 0

    @property
    def label(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        return f"world [{ranks}]" if self.world else f"group [{ranks}]"

    def collective(self, entry: FlightEntry | None = None) -> str:
        """``all_reduce #6 of group [2, 3]``."""
        entry = entry or self.expected
        op = entry.op if entry is not None else "collective"
        return f"{op} #{self.stuck_seq} of {self.label}"


@dataclass(frozen=True, slots=True)
class RootCause:
    rank: int
    kind: RootKind
    group: GroupState
    led_from: int
    """How many waiting ranks' chains end at this rank."""


@dataclass(frozen=True, slots=True)
class Diagnosis:
    groups: tuple[GroupState, ...]
    roots: tuple[RootCause, ...]
    waits: Mapping[int, tuple[GroupState, ...]]
    """``{rank: the stuck groups it waits in}``."""
    no_data: tuple[int, ...] = ()
    elsewhere: Mapping[int, tuple[tuple[GroupState, int, FlightEntry | None], ...]] = field(
        default_factory=dict
    )
    """``{rank: (group, number, entry)}``: collectives a rank waits in past its groups'
    stuck ones (it completed those: a size mismatch lets some ranks through)."""

    @property
    def root(self) -> RootCause | None:
        return self.roots[0] if self.roots else None


def _group_state(name: str, members: dict[int, RankTrace], ranks: tuple[int, ...]) -> GroupState:
    traces = {r: g for r, t in members.items() if (g := t.group(name)) is not None}
    world = any(g.world for g in traces.values())
    lowest = min(g.completed for g in traces.values())
    seq = lowest + 1
    if max(g.issued for g in traces.values()) < seq:
        return GroupState(name, ranks, world, lowest)
    issued = {r: g.entry(seq) for r, g in traces.items() if g.issued >= seq}
    missing = tuple(r for r in ranks if r in traces and traces[r].issued < seq)
    waiting = tuple(r for r in issued if traces[r].completed < seq)
    counts = Counter(e.signature for e in issued.values() if e is not None)
    expected: FlightEntry | None = None
    mismatched: tuple[int, ...] = ()
    if counts:
        top = max(counts.values())
        best = next(  # the most common signature; on a tie, the lowest rank's
            e.signature for r, e in sorted(issued.items()) if e and counts[e.signature] == top
        )
        expected = next(e for e in issued.values() if e is not None and e.signature == best)
        if len(counts) > 1:
            mismatched = tuple(
                sorted(r for r, e in issued.items() if e is not None and e.signature != best)
            )
    unknown = tuple(r for r in ranks if r not in traces)
    return GroupState(
        name, ranks, world, lowest, seq, issued, waiting, missing, mismatched, expected, unknown
    )


def _roots(groups: list[GroupState], waits: dict[int, tuple[GroupState, ...]]) -> list[RootCause]:
    stuck = [g for g in groups if g.stuck]
    blockers = {
        r: {b for g in gs for b in (*g.missing, *g.mismatched, *g.unknown)}
        for r, gs in waits.items()
    }
    led: Counter[int] = Counter()
    for start in waits:
        seen, todo = {start}, [start]
        while todo:
            r = todo.pop()
            nxt = blockers.get(r)
            if not nxt and r not in waits:
                led[r] += 1
                continue
            for b in nxt or ():
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
    roots: list[RootCause] = []
    for rank, count in sorted(led.items(), key=lambda kv: (-kv[1], kv[0])):
        own = [g for g in stuck if rank in g.missing or rank in g.unknown]
        # the group this rank alone blocks first, then the smallest one
        own.sort(key=lambda g: (len(g.missing) + len(g.unknown), len(g.ranks), g.name))
        if own:
            kind = RootKind.NEVER_ISSUED if rank in own[0].missing else RootKind.NO_DATA
            roots.append(RootCause(rank, kind, own[0], count))
    # evidence first: a rank whose own trace shows it never issued the collective ranks
    # above one that sent no trace (only suspected: busy, slow to answer, or dead)
    roots.sort(key=lambda root: root.kind is RootKind.NO_DATA)
    if not roots:  # everyone waits: a mismatch (or groups entered in opposite orders)
        for g in stuck:
            for rank in g.mismatched or g.missing:
                if all(r.rank != rank for r in roots):
                    kind = RootKind.MISMATCH if g.mismatched else RootKind.NEVER_ISSUED
                    roots.append(RootCause(rank, kind, g, len(g.waiting)))
    return roots


def analyse(traces: Mapping[int, RankTrace]) -> Diagnosis:
    """The collective view of a hang from the traces of every rank.

    For each process group, the first collective ``N`` that not all its members completed
    (one past the lowest completed number among the members). A member that issued nothing
    numbered ``N`` never issued it; one that issued a different op, sizes or dtypes there
    than most members did is a mismatch; the members that issued it and wait are the
    group's waiters. Waits are followed across groups: a waiter in group A waits for A's
    missing (and mismatched) ranks; if one of those waits in group B, it waits in turn for
    B's. The root is where the chains end: a rank that waits in no collective. When every
    rank waits (a mismatch, or two groups in opposite orders), the mismatched ranks are the
    root. Candidates are ordered by how many waiters lead to them.
    """
    ok = {r: t for r, t in traces.items() if t.error is None}
    no_data = tuple(sorted(r for r, t in traces.items() if t.error is not None))
    members: dict[str, set[int]] = {}
    for r, t in ok.items():
        for g in t.groups:
            members.setdefault(g.name, set()).update(g.ranks or (r,))
            members[g.name].add(r)
    groups = [
        _group_state(name, ok, tuple(sorted(ranks)))
        for name, ranks in sorted(members.items(), key=lambda kv: (len(kv[0]), kv[0]))
    ]
    waits: dict[int, tuple[GroupState, ...]] = {}
    for state in groups:
        for r in state.waiting:
            waits[r] = (*waits.get(r, ()), state)
    elsewhere: dict[int, tuple[tuple[GroupState, int, FlightEntry | None], ...]] = {}
    by_name = {g.name: g for g in groups}
    for r, t in sorted(ok.items()):
        for g in t.groups:
            seq = g.completed + 1
            state = by_name[g.name]
            if g.issued >= seq and seq != state.stuck_seq:
                elsewhere[r] = (*elsewhere.get(r, ()), (state, seq, g.entry(seq)))
    roots = tuple(_roots(groups, waits))
    return Diagnosis(tuple(groups), roots, waits, no_data, elsewhere)
