"""Step-time lanes of a job's report: each rank's step time over time, stragglers marked,
and each rank's arrival lag at the collectives where the agent sampled it.

Built from the ``step_times`` events (every measured rank's seconds per step, at most every
10 s or the window, with the median of the job) and the ``straggler`` events (a rank or
node that became slow, or recovered) that the agent judging stragglers writes
(``rallypoint._watch._stragglers._watch``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rallypoint._core.ranks import ranks_text
from rallypoint.observe._events import Event

__all__ = ["SlowSpan", "StepLanes", "StepSample", "build_lanes"]


@dataclass(frozen=True, slots=True)
class StepSample:
    """One rank's step time at ``t`` (seconds since the timeline's start)."""

    t: float
    step_s: float
    median_s: float
    """The median step time of the job's ranks at that time."""

    @property
    def ratio(self) -> float:
        return self.step_s / self.median_s if self.median_s > 0 else 1.0


@dataclass(frozen=True, slots=True)
class SlowSpan:
    """A rank reported slow from ``start`` to ``end`` (recovered, or the end of the job)."""

    rank: int
    start: float
    end: float
    label: str


@dataclass(slots=True)
class StepLanes:
    """What the lanes draw: samples per rank and the spans where a rank was slow."""

    end: float
    """Where the last sample of a lane stops (the job's end or the last event)."""
    ranks: list[int] = field(default_factory=list)
    samples: dict[int, list[StepSample]] = field(default_factory=dict)
    slow: list[SlowSpan] = field(default_factory=list)
    lags: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """``(t, seconds)``: each rank's median arrival lag at the collectives
    (``arrival_lags`` events: the Flight Recorder's view in lock-step training)."""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _add_samples(lanes: StepLanes, event: Event, t: float) -> None:
    step_s = event.get("step_s")
    median_s = _number(event.get("median_s"))
    if not isinstance(step_s, dict) or median_s is None:
        return
    for key, value in step_s.items():
        seconds = _number(value)
        if seconds is not None and str(key).isdigit():
            lanes.samples.setdefault(int(key), []).append(StepSample(t, seconds, median_s))


def _who(event: Event, ranks: list[int]) -> str:
    host = event.get("host")
    if event.get("scope") == "node":
        where = ", ".join(str(x) for x in (host, ranks_text(ranks)) if x)
        return f"node {event.get('group_rank', '?')} ({where})"
    return f"rank {ranks[0]}" + (f" on {host}" if host else "")


def _slow_label(event: Event, ranks: list[int], start: float, end: float | None) -> str:
    step_s, median_s = _number(event.get("step_s")), _number(event.get("median_s"))
    others = "nodes" if event.get("scope") == "node" else "ranks"
    label = f"straggler: {_who(event, ranks)}"
    lag_s, ratio = _number(event.get("lag_s")), _number(event.get("ratio"))
    if event.get("scope") == "arrival" and lag_s is not None and ratio is not None:
        label += (
            f": arrives last at the collectives, {lag_s * 1e3:.3g} ms after the others "
            f"(its pace {ratio:.1f}x theirs)"
        )
    elif step_s is not None and median_s:
        label += (
            f": {step_s:.3g} s per step, {step_s / median_s:.1f}x the median of the other "
            f"{others} ({median_s:.3g} s)"
        )
    until = f" to {end:.1f} s" if end is not None else ""
    return f"{label}; slow from {start:.1f} s{until}"


def _straggler_ranks(event: Event) -> list[int]:
    ranks = event.get("ranks")
    if isinstance(ranks, list):
        return sorted(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
    return [event.rank] if event.rank is not None else []


def build_lanes(ordered: Sequence[Event], t0: float, end: float) -> StepLanes | None:
    """The lanes of events sorted by time, or ``None`` when they hold no step times."""
    lanes = StepLanes(end=end)
    opened: dict[tuple[object, ...], tuple[Event, float, list[int]]] = {}
    for e in ordered:
        t = e.ts - t0
        if e.kind == "step_times":
            _add_samples(lanes, e, t)
        elif e.kind == "arrival_lags" and isinstance(lags := e.get("lag_s"), dict):
            for key, value in lags.items():
                if str(key).isdigit() and isinstance(value, int | float):
                    lanes.lags.setdefault(int(key), []).append((t, float(value)))
        elif e.kind == "straggler":
            ranks = _straggler_ranks(e)
            key = (e.get("round"), e.get("scope"), e.rank, e.get("group_rank"), tuple(ranks))
            if e.get("state") == "recovered":
                if key in opened:
                    first, start, rs = opened.pop(key)
                    lanes.slow += [
                        SlowSpan(r, start, t, _slow_label(first, rs, start, t)) for r in rs
                    ]
            elif ranks and key not in opened:
                opened[key] = (e, t, ranks)
    for first, start, rs in opened.values():
        label = _slow_label(first, rs, start, None)
        lanes.slow += [SlowSpan(r, start, max(end, start), label) for r in rs]
    if not lanes.samples and not lanes.slow and not lanes.lags:
        return None
    lanes.ranks = sorted(set(lanes.samples) | {s.rank for s in lanes.slow} | set(lanes.lags))
    return lanes
