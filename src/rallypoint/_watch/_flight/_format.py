"""The hang screen: the root-cause block, each group's collectives, then the grouped stacks.

:func:`format_hang_report` is what a hang (``--hang-timeout``) prints and what
``rallypoint stacks`` prints: with Flight Recorder data from the workers, a root-cause
block in the style of the failure summary (the rank, the collective it never issued or
mismatched, who waits for it and where it is), one line per group, then the stacks
grouped. Without data it says so in one line and prints the stacks. A sample screen is
in docs/diagnosis.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from rallypoint._core.frames import is_library
from rallypoint._core.ranks import ranks_text
from rallypoint._watch._flight._analysis import Diagnosis, GroupState, RootKind, analyse
from rallypoint._watch._flight._records import FlightEntry, RankTrace
from rallypoint._watch._stacks import StackDump
from rallypoint._watch._stacks_format import (
    format_frames,
    format_grouped_stacks,
    stack_summary,
    user_frames,
)

__all__ = ["format_collectives", "format_hang_report", "hang_report", "issuing_line"]


def issuing_line(entry: FlightEntry | None) -> str | None:
    """``train.py:15``: the innermost user frame that issued a recorded collective."""
    if entry is None:
        return None
    for filename, lineno, _name in entry.frames:
        if not is_library(filename):
            return f"{os.path.basename(filename)}:{lineno}"
    return None


def _describe(entry: FlightEntry | None) -> str:
    if entry is None:
        return "(entry no longer in the buffer)"
    sizes = ", ".join(str(list(s)) for s in entry.sizes)
    return f"{entry.op} of {sizes or 'no tensors'} {'/'.join(sorted(set(entry.dtypes)))}".rstrip()


def _what(diag: Diagnosis) -> str:
    root = diag.root
    assert root is not None
    g = root.group
    if root.kind is RootKind.MISMATCH:
        theirs = g.issued.get(root.rank)
        others = [r for r in g.issued if r not in g.mismatched]
        return (
            f"#{g.stuck_seq} of {g.label}: mismatch: rank {root.rank} issued {_describe(theirs)}"
            f", {ranks_text(sorted(others))} issued {_describe(g.expected)}"
        )
    if root.kind is RootKind.NO_DATA:
        return (
            f"{g.collective()}: the others wait in it; rank {root.rank} sent no Flight "
            "Recorder data (see its stack)"
        )
    return f"{g.collective()}: rank {root.rank} never issued it"


def _waiting_lines(diag: Diagnosis, culprit: int) -> list[str]:
    by_where: dict[tuple[str, str], list[int]] = {}
    for rank, groups in sorted(diag.waits.items()):
        if rank == culprit:
            continue
        for g in groups:
            entry = g.issued.get(rank)
            where = issuing_line(entry) or "?"
            by_where.setdefault((g.collective(entry), where), []).append(rank)
    for rank, pending in sorted(diag.elsewhere.items()):
        if rank == culprit or rank in diag.waits:
            continue
        for g, seq, entry in pending:
            op = entry.op if entry is not None else "collective"
            where = issuing_line(entry) or "?"
            by_where.setdefault((f"{op} #{seq} of {g.label}", where), []).append(rank)
    return [f"{ranks_text(rs)} in {what} ({where})" for (what, where), rs in by_where.items()]


def _root_block(diag: Diagnosis, dumps: Mapping[int, StackDump]) -> list[str]:
    root = diag.root
    assert root is not None
    dump = dumps.get(root.rank)
    g = root.group
    issuers = sorted(r for r in g.issued if r not in g.mismatched and g.issued[r] is not None)
    lines = [
        "Root cause (Flight Recorder):",
        f"  rank       : {root.rank}",
        f"  host       : {_where(dump) or '?'}",
        f"  collective : {_what(diag)}",
    ]
    if issuers:
        at = issuing_line(g.issued[issuers[0]])
        lines.append(f"  issued at  : {at or '?'} ({ranks_text(issuers)})")
    waiting = _waiting_lines(diag, root.rank)
    for i, line in enumerate(waiting):
        lines.append(("  waiting    : " if i == 0 else "               ") + line)
    main = dump.main if dump is not None else None
    if main is not None:
        lines.append(f"  rank {root.rank} is in: {stack_summary(main.frames)}")
        lines.extend(format_frames(user_frames(main.frames), "    "))
    for other in diag.roots[1:]:
        lines.append(f"  also       : rank {other.rank}: {other.group.collective()}")
    return lines


def _where(dump: StackDump | None) -> str:
    """``node7 (pid 4242)``: where a rank runs (``""``: not known)."""
    return f"{dump.host} (pid {dump.pid})" if dump is not None else ""


def _group_line(g: GroupState) -> str:
    if not g.stuck:
        return f"  {g.label}: " + (f"#{g.done} completed by all" if g.done else "no collective yet")
    head = f"  {g.label}: #{g.done} completed by all"
    parts = [f"#{g.stuck_seq} {g.expected.op if g.expected else 'collective'} pending"]
    if g.waiting:
        parts.append(f"waiting: {ranks_text(sorted(g.waiting))}")
    if g.missing:
        parts.append(f"never issued by {ranks_text(list(g.missing))}")
    if g.mismatched:
        parts.append(f"mismatch on {ranks_text(list(g.mismatched))}")
    if g.unknown:
        parts.append(f"no data from {ranks_text(list(g.unknown))}")
    return head + "; " + "; ".join(parts)


def format_collectives(diag: Diagnosis) -> list[str]:
    """One line per process group: what all completed, what is pending and where."""
    lines = ["Collectives by group (Flight Recorder):"]
    lines.extend(_group_line(g) for g in diag.groups)
    return lines


def format_hang_report(dumps: Mapping[int, StackDump], *, hang: bool = True) -> str:
    """The root-cause block (``hang``) and the collective view when there is data, then
    the stacks. ``hang=False`` (``rallypoint stacks`` on a running job, where a collective
    in flight is normal) leaves the root-cause block out."""
    return hang_report(dumps, hang=hang).text


class HangReport(NamedTuple):
    """What one analysis of a hang says."""

    text: str
    """:func:`format_hang_report`'s text."""
    culprit: str
    """The culprit in one line (``rank 3 on h (pid 9): all_reduce #1 of group [1, 3]: rank
    3 never issued it``; ``""`` without data or without a pending collective), for the
    failure summary."""
    rank: int | None = None
    """The culprit's global rank (``None``: not known)."""


def hang_report(dumps: Mapping[int, StackDump], *, hang: bool = True) -> HangReport:
    """The report of a hang, its culprit in one line and the culprit's rank, from one
    analysis of every rank's Flight Recorder."""
    traces: dict[int, RankTrace] = {r: d.flight for r, d in dumps.items() if d.flight is not None}
    stacks = format_grouped_stacks(dumps) if dumps else "(no stacks)\n"
    usable = [t for t in traces.values() if t.error is None and t.groups]
    if not usable:
        errors = {r: t.error for r, t in traces.items() if t.error}
        why = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) or "recording off"
        if len(set(errors.values())) == 1:
            why = next(iter(errors.values()))
        return HangReport(f"No Flight Recorder data ({why}): the Python stacks only.\n{stacks}", "")
    diag = analyse(traces)
    lines: list[str] = []
    if hang and diag.root is not None:
        lines.extend(_root_block(diag, dumps))
    elif hang:
        lines.append("Flight Recorder: no collective is pending in any group.")
    lines.extend(format_collectives(diag))
    for rank in diag.no_data:
        lines.append(f"  no Flight Recorder data from rank {rank}: {traces[rank].error}")
    culprit = ""
    if diag.root is not None:
        where = _where(dumps.get(diag.root.rank))
        culprit = f"rank {diag.root.rank}{' on ' + where if where else ''}: {_what(diag)}"
    root = diag.root.rank if diag.root is not None else None
    return HangReport("\n".join(lines) + "\n\n" + stacks, culprit, root)
