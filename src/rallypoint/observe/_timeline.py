"""A job's timeline, computed from its events: worker bars and marks, ready to draw.

Ranks on the y axis, time (seconds since the first event) on the x axis, one bar per
worker lifetime (``worker_start`` -> ``worker_exit``) coloured by how it ended, cut where
an in-process restart kept the process (``worker_kept``: the part before is drawn as
kept, and the process goes on in a new bar); rounds,
restarts, hangs and the end of the job as vertical marks; the root-cause ``failure`` as a
mark on its rank. Several files (one per node) are merged by time before this step.
Step times and stragglers become lanes below (``_step_lanes``) when the events hold them,
and so do replica groups' quorums (``_participation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rallypoint._core.status import WorkerStatus
from rallypoint.observe._events import Event
from rallypoint.observe._participation import Participation, build_participation
from rallypoint.observe._step_lanes import StepLanes, build_lanes

__all__ = [
    "FAILURE_COLOR",
    "MARK_STYLES",
    "STATE_COLORS",
    "Bar",
    "Mark",
    "Timeline",
    "build_timeline",
]

STATE_COLORS = {
    WorkerStatus.SUCCEEDED: "#2e7d32",
    WorkerStatus.FAILED: "#c62828",
    WorkerStatus.TERMINATED: "#9e9e9e",
    WorkerStatus.RUNNING: "#1565c0",
    WorkerStatus.KEPT: "#00897b",
}
MARK_STYLES = {  # kind -> (colour, legend label)
    "round": ("#607d8b", "round"),
    "restart": ("#6a1b9a", "restart"),
    "hang": ("#ef6c00", "hang detected"),
    "exclusion": ("#d81b60", "node excluded"),
    "job_end": ("#000000", "job end"),
}
FAILURE_COLOR = "#b71c1c"


@dataclass(frozen=True, slots=True)
class Bar:
    """One worker lifetime; times are seconds since the timeline's start."""

    rank: int
    start: float
    end: float
    state: WorkerStatus
    label: str


@dataclass(frozen=True, slots=True)
class Mark:
    """A vertical line (``rank`` is ``None``) or a point on one rank's row."""

    kind: str
    t: float
    label: str
    rank: int | None = None


@dataclass(slots=True)
class Timeline:
    """What the renderers draw, computed once from the events."""

    t0: float
    span: float
    ranks: list[int] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    title: str = "rallypoint job timeline"
    lanes: StepLanes | None = None
    """Step time per rank with the stragglers (``None`` without ``step_times`` events)."""
    groups: Participation | None = None
    """Replica groups in each quorum (``None`` without ``rallypoint.ft``'s events)."""


def _state_of(event: Event) -> WorkerStatus:
    state = event.get("state")
    if isinstance(state, str) and state in STATE_COLORS:
        return WorkerStatus(state)
    code = event.get("exitcode")
    if code == 0:
        return WorkerStatus.SUCCEEDED
    return WorkerStatus.FAILED if isinstance(code, int) else WorkerStatus.TERMINATED


def _exit_text(event: Event) -> str:
    code = event.get("exitcode")
    if isinstance(code, int) and code < 0:
        sig = event.get("signal") or f"signal {-code}"
        return f"killed by {sig}"
    return f"exit code {code}" if code is not None else str(event.get("state", "exited"))


def _worker_key(event: Event) -> tuple[object, ...]:
    pid = event.get("pid")
    if isinstance(pid, int):
        return (event.node, pid)
    return (event.node, event.get("round"), event.rank, event.local_rank)


def build_timeline(events: Sequence[Event]) -> Timeline:
    """Turn events (any order) into bars and marks; ``ValueError`` if there are none."""
    if not events:
        raise ValueError("no events to draw")
    ordered = sorted(events, key=lambda e: e.ts)
    t0 = ordered[0].ts
    t_last = ordered[-1].ts
    job_end = next((e for e in reversed(ordered) if e.kind == "job_end"), None)
    timeline = Timeline(t0=t0, span=max(t_last - t0, 1e-3))
    open_bars: dict[tuple[object, ...], Event] = {}
    ranks: set[int] = set()
    seen_rounds: set[object] = set()

    def rank_of(e: Event) -> int | None:
        return e.rank if e.rank is not None else e.local_rank

    for e in ordered:
        t = e.ts - t0
        r = rank_of(e)
        if e.kind == "worker_start" and r is not None:
            open_bars[_worker_key(e)] = e
            ranks.add(r)
        elif e.kind == "worker_kept" and r is not None:
            start = open_bars.pop(_worker_key(e), None)
            begin = start.ts - t0 if start is not None else 0.0
            label = _bar_label(start or e, r) + ": kept by an in-process restart"
            timeline.bars.append(Bar(r, begin, t, WorkerStatus.KEPT, label))
            open_bars[_worker_key(e)] = e
            ranks.add(r)
        elif e.kind == "worker_exit" and r is not None:
            start = open_bars.pop(_worker_key(e), None)
            ranks.add(r)
            begin = start.ts - t0 if start is not None else 0.0
            timeline.bars.append(
                Bar(r, begin, t, _state_of(e), _bar_label(start or e, r) + f": {_exit_text(e)}")
            )
        elif e.kind == "failure":
            if r is not None:
                ranks.add(r)
            what = e.get("message") or _exit_text(e)
            where = f"rank {r}" + (f" on {e.node}" if e.node else "") if r is not None else e.node
            timeline.marks.append(Mark("failure", t, f"root cause: {where}: {what}", r))
        elif e.kind == "round" and e.get("round") in seen_rounds:
            continue  # every agent logs the round; draw it once
        elif e.kind in MARK_STYLES:
            if e.kind == "round":
                seen_rounds.add(e.get("round"))
            timeline.marks.append(Mark(e.kind, t, _mark_label(e), None))
    end = (job_end.ts if job_end is not None else t_last) - t0
    for start in open_bars.values():
        r = rank_of(start)
        assert r is not None
        state = WorkerStatus.RUNNING if job_end is None else WorkerStatus.TERMINATED
        note = "still running at the last event" if job_end is None else "no exit recorded"
        begin = start.ts - t0
        bar = Bar(r, begin, max(end, begin), state, f"{_bar_label(start, r)}: {note}")
        timeline.bars.append(bar)
    timeline.ranks = sorted(ranks)
    timeline.lanes = build_lanes(ordered, t0, end)
    timeline.groups = build_participation(ordered, t0, end)
    run_ids = {e.get("run_id") for e in ordered if e.get("run_id")}
    if len(run_ids) == 1:
        timeline.title = f"rallypoint job {run_ids.pop()}"
    return timeline


def _bar_label(e: Event, rank: int) -> str:
    parts = [f"rank {rank}"]
    if e.local_rank is not None and e.rank is not None:
        parts.append(f"local {e.local_rank}")
    if e.node:
        parts.append(f"on {e.node}")
    if e.get("round") is not None:
        parts.append(f"round {e.get('round')}")
    if e.get("pid") is not None:
        parts.append(f"pid {e.get('pid')}")
    return ", ".join(parts)


def _mark_label(e: Event) -> str:
    if e.kind == "round":
        world = e.get("world_size")
        return f"round {e.get('round', '?')}" + (f" (world {world})" if world is not None else "")
    if e.kind == "restart":
        reason = e.get("reason")
        label = f"restart {e.get('restart_count', '')}".rstrip() + (f": {reason}" if reason else "")
        kept, replaced = e.get("kept"), e.get("replaced")
        if isinstance(kept, list) and isinstance(replaced, list):
            label += f" (in process: ranks {kept} kept, {replaced} replaced)"
        return label
    if e.kind == "exclusion":
        return str(e.get("reason") or f"excluded node {e.get('excluded', '?')}")
    if e.kind == "hang":
        idle = e.get("idle_s")
        number = isinstance(idle, int | float) and not isinstance(idle, bool)
        label = "hang" + (f" ({idle:.0f} s without progress)" if number else "")
        return label + (f", {e.get('action')}" if e.get("action") else "")
    status = e.get("status", "")
    return f"job end: {status}".rstrip(": ")
