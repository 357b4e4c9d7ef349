"""Drawing the step-time lanes (``_step_lanes``) under a report's timeline, with matplotlib.

One lane per rank: its step time as a colour strip (blue faster than the job's median,
grey at the median, red slower), downsampled to at most :data:`MAX_SEGMENTS` segments per
lane (the slowest sample of each bin is kept, so a straggler never disappears), and each
span where a rank was reported slow outlined in red with a marker where it was reported.
Where the agents sampled arrivals at the collectives (``arrival_lags`` events), each lane
also carries its rank's arrival lag as a black line (the lane's top edge: the largest lag
of the job; its bottom: none or early), and its label the last lag: in lock-step training
every step time is the same and the lag is where the straggler shows.
"""

from __future__ import annotations

from typing import Any

from rallypoint.observe._step_lanes import StepLanes, StepSample

__all__ = ["MAX_SEGMENTS", "SLOW_COLOR", "draw_lanes", "lane_tooltips"]

MAX_SEGMENTS = 300
"""Most colour segments drawn per lane (a long job's samples are binned)."""
SLOW_COLOR = "#b71c1c"
RATIO_RANGE = (0.25, 1.0, 4.0)
"""Step time / median drawn from full blue, through grey, to full red."""


def _segments(samples: list[StepSample], end: float, span: float) -> list[tuple[float, float]]:
    """``(start, ratio)`` of each segment to draw; each lasts until the next one starts."""
    if len(samples) <= MAX_SEGMENTS:
        return [(s.t, s.ratio) for s in samples]
    width = max(end, samples[-1].t) / MAX_SEGMENTS or span
    binned: dict[int, tuple[float, float]] = {}
    for s in samples:
        b = min(int(s.t / width), MAX_SEGMENTS - 1)
        start, ratio = binned.get(b, (s.t, 0.0))
        binned[b] = (min(start, s.t), max(ratio, s.ratio))
    return [binned[b] for b in sorted(binned)]


def _lane_label(rank: int, samples: list[StepSample]) -> str:
    if not samples:
        return f"rank {rank}: no step times recorded"
    steps = [s.step_s for s in samples]
    last = samples[-1]
    return (
        f"rank {rank}: {min(steps):.3g}-{max(steps):.3g} s per step; last {last.step_s:.3g} s "
        f"({last.ratio:.1f}x the job's median {last.median_s:.3g} s)"
    )


def _lag_label(lags: list[tuple[float, float]]) -> str:
    if not lags:
        return ""
    values = [lag for _, lag in lags]
    return (
        f"; arrives at the collectives {values[-1] * 1e3:.3g} ms after the others "
        f"(median lag; {min(values) * 1e3:.3g} to {max(values) * 1e3:.3g} ms over the job)"
    )


def lane_tooltips(lanes: StepLanes) -> dict[str, str]:
    """The tooltip of every lane and slow span, by the group id they are drawn with."""
    tips = {
        f"lane-{r}": _lane_label(r, lanes.samples.get(r, [])) + _lag_label(lanes.lags.get(r, []))
        for r in lanes.ranks
    }
    tips.update({f"slow-{i}": span.label for i, span in enumerate(lanes.slow)})
    return tips


def _tick_label(rank: int, lanes: StepLanes) -> str:
    lags = lanes.lags.get(rank)
    return f"rank {rank}\nlag {lags[-1][1] * 1e3:.3g} ms" if lags else f"rank {rank}"


def _draw_lags(ax: Any, lanes: StepLanes, y_of: dict[int, int]) -> float:
    """Each rank's arrival lag over time inside its lane; the largest lag drawn (0: none)."""
    peak = max((lag for series in lanes.lags.values() for _, lag in series), default=0.0)
    if peak <= 0:
        return 0.0
    for rank, series in sorted(lanes.lags.items()):
        y = y_of[rank]
        times = [t for t, _ in series] + [max(lanes.end, series[-1][0])]
        heights = [y + 0.3 - 0.6 * max(lag, 0.0) / peak for _, lag in series]
        ax.step(times, [*heights, heights[-1]], where="post", color="black", linewidth=1.0,
                gid=f"lag-{rank}")  # fmt: skip
    return peak


def draw_lanes(fig: Any, ax: Any, lanes: StepLanes, span: float) -> None:
    """Draw ``lanes`` on ``ax`` (a matplotlib Axes sharing x with the timeline)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import TwoSlopeNorm

    cmap = colormaps["coolwarm"]
    low, center, high = RATIO_RANGE
    norm = TwoSlopeNorm(vmin=low, vcenter=center, vmax=high)
    y_of = {r: i for i, r in enumerate(lanes.ranks)}
    tiny = span * 0.002
    for rank in lanes.ranks:
        segments = _segments(lanes.samples.get(rank, []), lanes.end, span)
        if not segments:  # slow without samples: an empty lane that still has its tooltip
            ax.broken_barh([(0.0, tiny)], (y_of[rank] - 0.3, 0.6), alpha=0, gid=f"lane-{rank}")
            continue
        ends = [start for start, _ in segments[1:]] + [max(lanes.end, segments[-1][0] + tiny)]
        ranges = [
            (start, max(stop - start, tiny))
            for (start, _), stop in zip(segments, ends, strict=True)
        ]
        colors = [cmap(norm(min(max(ratio, low), high))) for _, ratio in segments]
        ax.broken_barh(ranges, (y_of[rank] - 0.3, 0.6), facecolors=colors, gid=f"lane-{rank}")
    for i, slow in enumerate(lanes.slow):
        y = y_of[slow.rank]
        ax.broken_barh(
            [(slow.start, max(slow.end - slow.start, tiny))],
            (y - 0.42, 0.84),
            facecolors="none",
            edgecolors=SLOW_COLOR,
            linewidth=1.8,
            gid=f"slow-{i}",
        )
        ax.plot(slow.start, y - 0.42, marker="v", markersize=8, color=SLOW_COLOR)
    peak = _draw_lags(ax, lanes, y_of)
    ax.set_yticks(range(len(lanes.ranks)), [_tick_label(r, lanes) for r in lanes.ranks])
    ax.set_ylim(len(lanes.ranks) - 0.5, -0.5)
    ax.set_title(
        "step time per rank (between progress() calls) relative to the job's median; "
        "red outline: reported straggler"
        + (f";\nblack line: arrival lag at the collectives (lane top: {peak * 1e3:.3g} ms)"
           if peak > 0 else ""),
        loc="left",
        fontsize=9,
    )  # fmt: skip
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap),
        ax=ax,
        location="bottom",
        label="step time / job median",
        ticks=[low, 0.5, center, 2.0, high],
        fraction=0.08,
        aspect=60,
    )
