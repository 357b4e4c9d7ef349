"""Draw a job's timeline once, with matplotlib, as PNG, SVG or a self-contained HTML page.

matplotlib (the optional ``plot`` extra) is imported only here, and only its object API is
used (a ``Figure`` on the Agg canvas: no pyplot, no global backend change). The SVG is
matplotlib's own, with text kept as text, a ``<title>`` tooltip added to every bar and mark,
and nothing that points outside the file; the HTML page embeds it inline.
"""

from __future__ import annotations

import html
import io
import os
import re
from collections.abc import Sequence
from typing import Any

from rallypoint.observe._events import Event
from rallypoint.observe._participation_plot import draw_participation, participation_tooltips
from rallypoint.observe._step_lanes_plot import SLOW_COLOR, draw_lanes, lane_tooltips
from rallypoint.observe._timeline import (
    FAILURE_COLOR,
    MARK_STYLES,
    STATE_COLORS,
    Timeline,
    build_timeline,
)

__all__ = ["SUFFIXES", "render_report", "timeline_svg"]

SUFFIXES = (".png", ".html", ".htm", ".svg")
INSTALL_HINT = "drawing a report needs matplotlib: pip install 'rallypoint[plot]'"

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "rallypoint"}


def _text(text: str) -> str:
    """Text as drawn: characters that XML cannot hold at all become U+FFFD."""
    return _NOT_XML.sub("\ufffd", text)


def render_report(events: Sequence[Event], out_path: str | os.PathLike[str]) -> str:
    """Draw the timeline of ``events`` to ``out_path`` (``.png``, ``.html``/``.htm``, ``.svg``).

    Returns the path written. ``ValueError`` for an unknown suffix or no events;
    ``ImportError`` that says to install ``rallypoint[plot]`` without matplotlib.
    """
    path = os.fspath(out_path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"cannot write {path!r}: the output must end in .png, .html or .svg, not {suffix!r}"
        )
    timeline = build_timeline(events)
    if suffix == ".png":
        _figure(timeline).savefig(path, dpi=110, format="png")
        return path
    svg = timeline_svg(timeline)
    if suffix != ".svg":
        title = html.escape(_text(timeline.title))
        svg = (
            "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{title}</title></head>\n<body style='font-family:sans-serif'>\n"
            f"{svg}\n</body></html>\n"
        )
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(svg)
    return path


def timeline_svg(timeline: Timeline) -> str:
    """The timeline as one ``<svg>`` element with a tooltip on every bar and mark."""
    buf = io.StringIO()
    with _matplotlib().rc_context(_SVG_RC):
        _figure(timeline).savefig(buf, format="svg", metadata={"Date": None})
    return _standalone(buf.getvalue(), _tooltips(timeline))


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return matplotlib


def _tooltips(tl: Timeline) -> dict[str, str]:
    tips = {f"bar-{i}": bar.label for i, bar in enumerate(tl.bars)}
    tips.update({f"mark-{i}": mark.label for i, mark in enumerate(tl.marks)})
    if tl.lanes is not None:
        tips.update(lane_tooltips(tl.lanes))
    if tl.groups is not None:
        tips.update(participation_tooltips(tl.groups))
    return tips


def _standalone(svg: str, tooltips: dict[str, str]) -> str:
    """matplotlib's SVG as an inline element: no prolog or metadata, ``<title>`` tooltips
    on the groups named by ``tooltips``, SVG 2 ``href`` instead of the xlink namespace."""
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.DOTALL)
    svg = svg.replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "")
    svg = svg.replace("xlink:href=", "href=")
    for gid, label in tooltips.items():
        opening = f'<g id="{gid}">'
        svg = svg.replace(opening, f"{opening}<title>{html.escape(_text(label))}</title>", 1)
    return svg


def _label_levels(tl: Timeline) -> dict[int, int]:
    """Stagger the labels of vertical marks that are close in time (index -> level 0..3)."""
    levels: dict[int, int] = {}
    placed: list[tuple[float, int]] = []
    for i, mark in sorted(enumerate(tl.marks), key=lambda im: im[1].t):
        if mark.rank is not None:
            continue
        near = {lvl for t, lvl in placed if abs(t - mark.t) < tl.span * 0.06}
        level = next(lvl for lvl in range(5) if lvl not in near or lvl == 4)
        levels[i] = min(level, 3)
        placed.append((mark.t, levels[i]))
    return levels


def _figure(tl: Timeline) -> Any:
    """The timeline drawn on a new matplotlib ``Figure`` (Agg canvas)."""
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(len(tl.ranks), 1)
    heights = [n + 0.6]  # the workers; then step-time lanes, then replica groups if any
    if tl.lanes is not None:
        heights.append(0.75 * len(tl.lanes.ranks) + 1.2)
    if tl.groups is not None:
        heights.append(0.5 * len(tl.groups.groups) + 0.8)
    extra = sum(heights[1:])
    fig = Figure(figsize=(11, 1.6 + 0.4 * n + 0.4 * extra), layout="constrained")
    axes = list(
        fig.subplots(len(heights), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    )
    ax, below = axes[0], axes[1:]
    if tl.lanes is not None:
        draw_lanes(fig, below.pop(0), tl.lanes, tl.span)
    if tl.groups is not None:
        draw_participation(below.pop(0), tl.groups, tl.span)
    axes[-1].set_xlabel("seconds since the first event")
    for lower in axes[1:]:
        lower.grid(axis="x", color="#eeeeee")
    FigureCanvasAgg(fig)
    y_of = {r: i for i, r in enumerate(tl.ranks)}
    for i, bar in enumerate(tl.bars):
        bars = ax.barh(
            y_of[bar.rank],
            max(bar.end - bar.start, tl.span * 0.002),
            left=bar.start,
            height=0.6,
            color=STATE_COLORS[bar.state],
            alpha=0.85,
        )
        bars.patches[0].set_gid(f"bar-{i}")
    _draw_marks(ax, tl, y_of)
    ax.set_yticks(range(len(tl.ranks)), [f"rank {r}" for r in tl.ranks])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, tl.span * 1.02)
    ax.set_title(_text(tl.title), loc="left", pad=40, parse_math=False)
    ax.grid(axis="x", color="#eeeeee")
    _legend(fig, stragglers=tl.lanes is not None)
    return fig


def _draw_marks(ax: Any, tl: Timeline, y_of: dict[int, int]) -> None:
    levels = _label_levels(tl)
    for i, mark in enumerate(tl.marks):
        if mark.rank is not None:
            (cross,) = ax.plot(
                mark.t, y_of[mark.rank], marker="x", markersize=11, mew=3, color=FAILURE_COLOR
            )
            cross.set_gid(f"mark-{i}")
            continue
        color = MARK_STYLES.get(mark.kind, (FAILURE_COLOR, ""))[0]
        style = "--" if mark.kind in ("restart", "hang") else "-"
        ax.axvline(mark.t, color=color, linestyle=style, linewidth=1.5, gid=f"mark-{i}")
        ax.annotate(
            _text(mark.label.split(":")[0].split(" (")[0]),
            (mark.t, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2 + 9 * levels.get(i, 0)),
            textcoords="offset points",
            fontsize=7,
            color=color,
            parse_math=False,
        )


def _legend(fig: Any, *, stragglers: bool) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Patch | Line2D] = [
        Patch(color=c, label=f"worker {s}") for s, c in STATE_COLORS.items()
    ]
    handles += [Line2D([], [], color=c, label=label) for c, label in MARK_STYLES.values()]
    handles.append(
        Line2D([], [], color=FAILURE_COLOR, marker="x", mew=3, ls="", label="root-cause failure")
    )
    if stragglers:
        handles.append(
            Patch(facecolor="none", edgecolor=SLOW_COLOR, linewidth=1.8, label="straggler")
        )
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
