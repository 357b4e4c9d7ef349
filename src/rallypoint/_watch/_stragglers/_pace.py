"""Straggler detection from progress heartbeats: the measuring window and the verdicts.

Pure logic, no I/O (``_watch`` samples the board, exchanges summaries, prints). A rank's
step time is the mean time between its consecutive :func:`rallypoint.progress` calls,
measured exactly from the board's last-call times and step counts over a sliding window
(:class:`PaceWindow`). :class:`StragglerDetector` compares each rank's (or node's) step
time with the median of the others' and reports each change of state once.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DEFAULT_THRESHOLD",
    "MIN_STEPS",
    "MIN_WINDOW_S",
    "PACE_EVERY",
    "WINDOW_S",
    "NodePace",
    "PaceWindow",
    "RankPace",
    "Straggler",
    "StragglerDetector",
    "check_window",
    "lower_median",
    "median",
    "pace_every",
    "parse_threshold",
]

DEFAULT_THRESHOLD = 1.5
"""``--straggler-threshold`` unless given: 1.5 times the median step time."""
PACE_EVERY = 2.0
"""Seconds between two samples of the board (and, across nodes, two summaries per node)."""
WINDOW_S = 30.0
"""``--straggler-window`` unless given: seconds of history a step time averages over (at
least :data:`MIN_STEPS` steps)."""
MIN_WINDOW_S = 0.5
"""The shortest ``--straggler-window``."""
MIN_STEPS = 5
"""Steps a rank must have made (in its window) before it is judged."""
_MAX_SAMPLES = 4096
"""Bound on the samples a window keeps (only reached with :data:`MIN_STEPS` huge)."""


def parse_threshold(value: object, what: str = "straggler_threshold") -> float | None:
    """``value`` as a straggler threshold: a float > 1, or ``None`` (off) for ``None`` or
    ``"off"``. ``TypeError``/``ValueError`` name ``what`` and say what to pass."""
    if value is None:
        return None
    rule = (
        f"{what} must be a number greater than 1 (a rank slower than that many times the "
        "median step time is a straggler), or 'off' to disable it"
    )
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "off":
            return None
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{rule}; got {value!r}") from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{rule}; got {type(value).__name__} {value!r}")
    if not math.isfinite(number) or number <= 1.0:
        raise ValueError(f"{rule}; got {value!r}")
    return number


def check_window(value: object, what: str = "straggler_window") -> float:
    """``value`` (a ``timedelta``, or seconds) as a window length in seconds, at least
    :data:`MIN_WINDOW_S`; ``TypeError``/``ValueError`` name ``what``."""
    from rallypoint._core.checks import MAX_SECONDS, check_seconds

    seconds = check_seconds(value, what, numbers=True, maximum=MAX_SECONDS)
    assert seconds is not None
    if seconds < MIN_WINDOW_S:
        raise ValueError(
            f"{what} must be at least {MIN_WINDOW_S:g} s (the step times are averaged over "
            f"it), got {seconds:g} s"
        )
    return seconds


def pace_every(window_s: float) -> float:
    """Seconds between two samples of the board for a window of ``window_s`` seconds:
    :data:`PACE_EVERY`, or a fifth of a shorter window."""
    return min(PACE_EVERY, window_s / 5)


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def lower_median(values: Sequence[float]) -> float:
    """The lower median (of an even count, the smaller middle value): a node's pace, so
    that a node counts as slow only when most of its ranks are."""
    if not values:
        raise ValueError("median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def _medians_of_others(values: Sequence[float]) -> list[float | None]:
    """For each value, the median of all the others (``None`` when there are none).

    One sort, then O(1) per value: removing position ``i`` of the sorted list shifts the
    positions above it down by one.
    """
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=lambda k: values[k])
    s = [values[k] for k in order]
    out: list[float | None] = [None] * n
    m = n - 1

    def at(j: int, removed: int) -> float:
        return s[j if j < removed else j + 1]

    for pos, k in enumerate(order):
        if m % 2:
            out[k] = at(m // 2, pos)
        else:
            out[k] = (at(m // 2 - 1, pos) + at(m // 2, pos)) / 2
    return out


# ---------------------------------------------------------------------------- the window
class PaceWindow:
    """One node's sliding windows of ``(time of the last progress, steps)`` per local rank.

    The window is the most recent :data:`WINDOW_S` seconds, stretched back to hold at least
    :data:`MIN_STEPS` steps when steps are slower than that. A rank is judged once it has
    made :data:`MIN_STEPS` steps in the current attempt. A step still open counts when it is
    already longer than the window's mean, so a rank that stopped calling ``progress()``
    gets slower instead of keeping its old pace.
    """

    def __init__(
        self, nslots: int, *, window_s: float = WINDOW_S, min_steps: int = MIN_STEPS
    ) -> None:
        if window_s <= 0 or min_steps < 1:
            raise ValueError("window_s must be > 0 and min_steps >= 1")
        self.window_s = window_s
        self.min_steps = min_steps
        self._samples: list[deque[tuple[float, int]]] = [deque() for _ in range(nslots)]

    def add(self, now: float, slots: Sequence[tuple[float, int]]) -> None:
        """Record a sample of the board (:meth:`ProgressBoard.sample`) taken at ``now``."""
        for window, (last, steps) in zip(self._samples, slots, strict=True):
            if steps <= 0:
                window.clear()  # not reported yet (or the board was reset)
                continue
            if window and window[-1][1] == steps:
                continue  # no step since the last sample
            if window and window[-1][1] > steps:
                window.clear()  # the board was reset under us
            window.append((last, steps))
            self._trim(window, now)

    def _trim(self, window: deque[tuple[float, int]], now: float) -> None:
        newest = window[-1][1]
        while len(window) > 2:
            second_last, second_steps = window[1]
            covers_time = now - second_last >= self.window_s
            covers_steps = newest - second_steps >= self.min_steps
            if not (covers_time and covers_steps) and len(window) <= _MAX_SAMPLES:
                break
            window.popleft()

    def step_time(self, slot: int, now: float) -> tuple[float, int] | None:
        """``(seconds per step, steps)`` over ``slot``'s window, or ``None`` before
        :attr:`min_steps` steps."""
        window = self._samples[slot]
        if len(window) < 2:
            return None
        (t0, s0), (t1, s1) = window[0], window[-1]
        steps = s1 - s0
        if steps < self.min_steps:
            return None
        mean = (t1 - t0) / steps
        still_open = now - t1
        if still_open > mean:  # the open step is slow already: count it as ending now
            return (t1 - t0 + still_open) / (steps + 1), steps
        return mean, steps


# ---------------------------------------------------------------------------- summaries
@dataclass(frozen=True, slots=True)
class RankPace:
    """One rank's step time over its window."""

    rank: int
    step_s: float
    steps: int


@dataclass(frozen=True, slots=True)
class NodePace:
    """One node's summary: what it publishes to the other nodes every :data:`PACE_EVERY` s."""

    group_rank: int
    host: str
    seq: int
    """Counts the summaries of this node in this round: a frozen ``seq`` is a stale node."""
    ranks: tuple[RankPace, ...]
    """The node's running ranks that have a step time."""
    running: int = 0
    """How many ranks run on the node: it is judged as a node once all have a step time."""

    def to_json(self) -> str:
        ranks = [[r.rank, float(f"{r.step_s:.4g}"), r.steps] for r in self.ranks]
        record = {
            "g": self.group_rank,
            "host": self.host,
            "seq": self.seq,
            "ranks": ranks,
            "n": self.running,
        }
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodePace:
        """Parse a summary; ``ValueError`` for anything else."""
        try:
            obj: Any = json.loads(raw)
            ranks = tuple(
                RankPace(int(rank), float(step_s), int(steps))
                for rank, step_s, steps in obj["ranks"]
            )
            pace = cls(int(obj["g"]), str(obj["host"]), int(obj["seq"]), ranks, int(obj["n"]))
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"not a node pace summary: {exc}") from None
        if any(not math.isfinite(r.step_s) or r.step_s < 0 for r in ranks):
            raise ValueError("not a node pace summary: a step time is not a finite number >= 0")
        return pace


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank or node that became slow (``slow``) or recovered (``not slow``)."""

    scope: Literal["rank", "node"]
    key: int
    """The rank, or the node's group rank."""
    group_rank: int
    """The group rank of the node (of the rank)."""
    host: str
    ranks: tuple[int, ...]
    step_s: float
    median_s: float
    """The median step time of the other ranks (or nodes) it was compared with."""
    slow: bool

    @property
    def ratio(self) -> float:
        return self.step_s / self.median_s if self.median_s > 0 else math.inf


# ---------------------------------------------------------------------------- the verdicts
class StragglerDetector:
    """Compares step times with the median and reports each change of state once.

    A rank is slow when its step time exceeds ``threshold`` times the median of the other
    ranks' (leaving the rank out keeps a two-rank job able to name its slow rank). With
    several nodes, a node is slow when the lower median of its ranks' step times exceeds
    ``threshold`` times the median of the other nodes', and is reported as one node. A rank
    or node recovers when its ratio falls to ``1 + (threshold - 1) / 2`` (hysteresis: no
    report storm at the boundary), and only one that recovered is reported again.
    """

    def __init__(self, threshold: float) -> None:
        checked = parse_threshold(threshold, "threshold")
        if checked is None:
            raise ValueError("threshold must be > 1 (a detector that is off is not created)")
        self.threshold = checked
        self.recover_at = 1.0 + (checked - 1.0) / 2.0
        self._slow: set[tuple[str, int]] = set()

    def update(self, nodes: Iterable[NodePace]) -> list[Straggler]:
        """Judge the latest summaries; return the ranks/nodes that changed state."""
        nodes = [n for n in nodes if n.ranks]
        whole = [n for n in nodes if len(n.ranks) >= n.running]
        changes = self._judge_nodes(whole) if len(whole) > 1 else []
        slow_nodes = {n.group_rank for n in nodes if ("node", n.group_rank) in self._slow}
        ranks = [(r, n) for n in nodes for r in n.ranks]
        others = _medians_of_others([r.step_s for r, _ in ranks])
        for (pace, node), med in zip(ranks, others, strict=True):
            if med is None or node.group_rank in slow_nodes:
                continue  # nothing to compare with, or reported as a whole node
            change = self._change(("rank", pace.rank), pace.step_s, med)
            if change is not None:
                changes.append(
                    Straggler(
                        "rank",
                        pace.rank,
                        node.group_rank,
                        node.host,
                        (pace.rank,),
                        pace.step_s,
                        med,
                        change,
                    )
                )
        return changes

    def _judge_nodes(self, nodes: Sequence[NodePace]) -> list[Straggler]:
        paces = [lower_median([r.step_s for r in n.ranks]) for n in nodes]
        changes = []
        for node, pace, med in zip(nodes, paces, _medians_of_others(paces), strict=True):
            assert med is not None  # two nodes or more
            change = self._change(("node", node.group_rank), pace, med)
            if change is not None:
                ranks = tuple(sorted(r.rank for r in node.ranks))
                g = node.group_rank
                changes.append(Straggler("node", g, g, node.host, ranks, pace, med, change))
        return changes

    def _change(self, key: tuple[str, int], step_s: float, med: float) -> bool | None:
        """``True``: became slow; ``False``: recovered; ``None``: no change."""
        ratio = step_s / med if med > 0 else math.inf
        if key in self._slow:
            if ratio <= self.recover_at:
                self._slow.discard(key)
                return False
        elif ratio > self.threshold:
            self._slow.add(key)
            return True
        return None

    def is_slow(self, scope: Literal["rank", "node"], key: int) -> bool:
        return (scope, key) in self._slow
