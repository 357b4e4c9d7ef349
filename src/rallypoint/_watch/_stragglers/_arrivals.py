"""Stragglers in lock-step training, from the arrival times the Flight Recorder records.

In lock-step training (DDP, FSDP) every rank waits in the gradient collectives for the
slowest, so every rank's step time is the same and a step-time comparison names nobody.
The arrivals differ: torch records when each rank issues each collective.
:func:`judge_arrivals` names the rank that arrives last at most collectives when the
others wait for it long enough. With NCCL, where the CPUs run ahead of their GPUs, the
collectives' GPU durations are used instead of the enqueue times.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from rallypoint._watch._flight._records import FlightEntry, RankTrace

__all__ = [
    "MAX_RATIO",
    "MIN_COLLECTIVES",
    "MIN_SHARE",
    "ArrivalVerdict",
    "arrivals_since",
    "is_straggler",
    "judge_arrivals",
]

MIN_COLLECTIVES = 10
"""Complete collectives (issued by every member) the window must hold to judge."""
MIN_SHARE = 0.6
"""The share of them at which one rank must arrive last to be named."""
MAX_RATIO = 1000.0
"""The highest pace ratio a verdict states: the others waited for the rank for (nearly)
the whole span, so that their own compute, the ratio's denominator, is (nearly) nothing."""


@dataclass(frozen=True, slots=True)
class ArrivalVerdict:
    """The rank that arrives last most often, and how much the others wait for it."""

    rank: int
    last: int
    """At how many of the ``collectives`` it arrived last."""
    collectives: int
    lag_s: float
    """Its median lag (seconds after the median of the others' arrivals)."""
    ratio: float
    """``D / (D - W)``: its pace over the others' (see :func:`judge_arrivals`); finite, at
    most :data:`MAX_RATIO`."""
    lags_s: Mapping[int, float]
    """Every rank's median lag, for the report's lane."""

    @property
    def share(self) -> float:
        return self.last / self.collectives if self.collectives else 0.0


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _collectives(
    traces: Mapping[int, RankTrace], offsets: Mapping[int, int], since_ns: int, subset: bool
) -> list[dict[int, int]]:
    """``{rank: arrival}`` of every collective every member issued (every member in
    ``traces`` with ``subset``), newer than ``since_ns``."""
    found: list[dict[int, int]] = []
    names = {g.name for t in traces.values() if t.error is None for g in t.groups}
    for name in sorted(names):
        members = {r: g for r, t in traces.items() if t.error is None and (g := t.group(name))}
        ranks = set().union(*(g.ranks for g in members.values())) or set(members)
        if len(members) < 2 or not (subset or ranks <= set(members)):
            continue  # a group with one member, or one without data from every member
        seqs = set.intersection(*({e.seq for e in g.entries} for g in members.values()))
        for seq in sorted(seqs):
            entries = {}
            for r, g in members.items():
                entry = g.entry(seq)
                assert entry is not None  # seq is in every member's
                entries[r] = entry
            arrival = _arrival(entries, offsets)
            if min(arrival.values()) >= since_ns:
                found.append(arrival)
    return found


def _arrival(entries: Mapping[int, FlightEntry], offsets: Mapping[int, int]) -> dict[int, int]:
    """Each rank's arrival at one collective: on the GPU where every member measured its
    time there (it ends at the same moment on all: a rank that ran it for less arrived
    later), else when its CPU issued it."""
    issued = {r: e.created_ns - offsets.get(r, 0) for r, e in entries.items()}
    timed = {r: e.duration_ns for r, e in entries.items() if e.duration_ns is not None}
    if len(timed) < len(entries):
        return issued
    end = int(statistics.median(issued.values())) + max(timed.values())
    return {r: end - d for r, d in timed.items()}


def judge_arrivals(
    traces: Mapping[int, RankTrace],
    *,
    window_s: float,
    offsets: Mapping[int, int] | None = None,
    subset: bool = False,
) -> ArrivalVerdict | None:
    """The rank the others wait for, or ``None`` without enough collectives in the last
    ``window_s`` seconds (of the newest arrival).

    For every collective that all members of its group issued, the last rank to arrive and
    its lag (its arrival minus the median of the others') are known. The rank that arrives
    last at most of them (at least :data:`MIN_SHARE`, over at least
    :data:`MIN_COLLECTIVES`) is a straggler when the others wait for it long enough: ``W``,
    the time covered by the union of its lag intervals (back-to-back bucket collectives of
    one step overlap: one wait per step), over ``D``, the span of those collectives, gives
    the others' compute ``D - W`` against its ``D``; it is named when ``D / (D - W)``
    exceeds ``--straggler-threshold``. Where every member measured the collective on its
    GPU (``duration_ns``, NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``), the rank that spent the
    least time in it arrived last, by the difference: no clock enters.

    ``offsets``: nanoseconds to subtract per rank (its node's clock minus the judge's,
    ``_clock_offset``), which put every rank on one clock.

    ``subset``: ``traces`` are some members of the groups (one node's ranks of a larger
    job); arrivals are compared among them only.
    """
    offsets = offsets or {}
    newest = max(
        (e.created_ns - offsets.get(t.rank, 0) for t in traces.values() if t.error is None
         for g in t.groups for e in g.entries),
        default=None,
    )  # fmt: skip
    if newest is None:
        return None
    found = _collectives(traces, offsets, newest - int(window_s * 1e9), subset)
    if len(found) < MIN_COLLECTIVES:
        return None
    lags: dict[int, list[float]] = {}
    last: dict[int, int] = {}
    intervals: dict[int, list[tuple[int, int]]] = {}
    for arrival in found:
        for r, t in arrival.items():
            others = [v for o, v in arrival.items() if o != r]
            lags.setdefault(r, []).append((t - statistics.median(others)) / 1e9)
        late = max(arrival, key=lambda r: (arrival[r], r))
        last[late] = last.get(late, 0) + 1
        others_median = int(statistics.median(v for o, v in arrival.items() if o != late))
        intervals.setdefault(late, []).append((others_median, arrival[late]))
    rank = max(last, key=lambda r: (last[r], -r))
    span = max(max(a.values()) for a in found) - min(min(a.values()) for a in found)
    waited = _union(intervals[rank])
    return ArrivalVerdict(
        rank=rank,
        last=last[rank],
        collectives=len(found),
        lag_s=statistics.median(lags[rank]),
        ratio=_pace_ratio(span, waited),
        lags_s={r: statistics.median(v) for r, v in sorted(lags.items())},
    )


def _pace_ratio(span: int, waited: int) -> float:
    """``D / (D - W)``, at most :data:`MAX_RATIO` (the others waited the whole span: no
    compute of theirs to divide by); 1 when nobody waited."""
    if waited <= 0:
        return 1.0
    if span - waited <= span / MAX_RATIO:
        return MAX_RATIO
    return span / (span - waited)


def arrivals_since(traces: Mapping[int, RankTrace], since_ns: int) -> dict[int, RankTrace]:
    """``traces`` without the entries created before ``since_ns`` (the clock of their node):
    a worker kept by an in-process restart still holds the previous attempt's collectives,
    whose numbers the new attempt's groups count again from 1."""
    return {
        rank: replace(
            trace,
            groups=tuple(
                replace(g, entries=tuple(e for e in g.entries if e.created_ns >= since_ns))
                for g in trace.groups
            ),
        )
        for rank, trace in traces.items()
    }


def is_straggler(verdict: ArrivalVerdict | None, threshold: float) -> bool:
    """Whether ``verdict`` names a straggler at ``threshold``."""
    return (
        verdict is not None
        and verdict.collectives >= MIN_COLLECTIVES
        and verdict.share >= MIN_SHARE
        and verdict.ratio > threshold
    )
