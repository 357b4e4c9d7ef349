"""Replica-group participation in a job's report: which groups were in each step's quorum.

Built from the ``quorum`` and ``heal`` events that ``rallypoint.ft``'s groups write beside
their agents' events (``rallypoint run --events``; fields in docs/multinode.md). Every group
in a quorum writes it, so a quorum is kept once (its id and its groups), at the time the
first group wrote it; it lasts until the next quorum. Who left and who joined is taken
from one quorum to the next here (each group wrote it against the last quorum it was in),
with the reasons any of its writers gave; a group they say left that is in the new quorum
again restarted between the two, so it left and joined. A group's lane is filled where it was in the
quorum and empty where it was out; its heals are marks on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rallypoint._core.quorum_line import quorum_line
from rallypoint.observe._events import Event

__all__ = ["Change", "Heal", "Participation", "Span", "build_participation"]


@dataclass(frozen=True, slots=True)
class Span:
    """Group ``group`` in a quorum from ``start`` to ``end`` (seconds); ``label`` names it."""

    group: str
    start: float
    end: float
    label: str


@dataclass(frozen=True, slots=True)
class Change:
    """A new quorum at ``t``: ``quorum 7: groups 0, 2 (group 1 left: ...)``."""

    t: float
    label: str


@dataclass(frozen=True, slots=True)
class Heal:
    group: str
    t: float
    label: str


@dataclass(slots=True)
class Participation:
    groups: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    heals: list[Heal] = field(default_factory=list)


def _group_order(group: str) -> tuple[int, int | str]:
    return (0, int(group)) if group.isdigit() else (1, group)


def _names(value: object) -> list[str]:
    return [str(g) for g in value] if isinstance(value, list) else []


def _change_label(
    quorum: object, groups: list[str], before: list[str], why: dict[str, str], at: dict[str, object]
) -> str:
    # a group its writers say left may be back already (a fast restart): it left and joined
    left = [(g, why.get(g)) for g in before if g not in groups or g in why]
    joined = [(g, at.get(g)) for g in groups if before and (g not in before or g in why)]
    return quorum_line(quorum, groups, left, joined)


def _heal_label(e: Event) -> str:
    size, seconds = e.get("bytes"), e.get("seconds")
    amount = ""
    if isinstance(size, int | float) and isinstance(seconds, int | float):
        amount = f" ({size / 1e6:.1f} MB in {seconds:.2f} s)"
    return (
        f"group {e.get('group', '?')} healed from group {e.get('source', '?')} "
        f"at step {e.get('step', '?')}{amount}"
    )


def build_participation(ordered: Sequence[Event], t0: float, end: float) -> Participation | None:
    """Each group's participation from events sorted by time (``None``: no quorums)."""
    quorums: dict[
        tuple[object, tuple[str, ...]], tuple[float, Event, dict[str, str], dict[str, object]]
    ] = {}
    out = Participation()
    for e in ordered:
        if e.kind == "quorum":
            groups = _names(e.get("groups"))
            if not groups:
                continue
            key = (e.get("quorum"), tuple(groups))  # every group in it wrote it: kept once
            t, first, why, at = quorums.setdefault(key, (e.ts - t0, e, {}, {}))
            left, joined = e.get("left"), e.get("joined")
            if isinstance(left, dict):
                why.update({str(g): str(r) for g, r in left.items()})
            if isinstance(joined, dict):
                at.update({str(g): s for g, s in joined.items()})
        elif e.kind == "heal" and e.get("group") is not None:
            out.heals.append(Heal(str(e.get("group")), e.ts - t0, _heal_label(e)))
    if not quorums:
        return None
    everyone: set[str] = {h.group for h in out.heals}
    ordered_q = list(quorums.items())
    before: list[str] = []
    for i, ((number, members), (t, first, why, at)) in enumerate(ordered_q):
        groups = list(members)
        stop = ordered_q[i + 1][1][0] if i + 1 < len(ordered_q) else max(end, t)
        label = _change_label(number, groups, before, why, at)
        out.changes.append(Change(t, label))
        step = first.get("step")
        for g in groups:
            everyone.add(g)
            out.spans.append(Span(g, t, stop, f"group {g} in {label}; from step {step}"))
        before = groups
    out.groups = sorted(everyone, key=_group_order)
    return out
