"""``rallypoint report EVENTS [EVENTS ...] [-o OUT.png|OUT.html|OUT.svg]``: a job's timeline.

Ranks on the y axis, time (seconds since the first event) on the x axis, one bar per worker
lifetime (``worker_start`` → ``worker_exit``) coloured by how it ended; rounds, restarts,
hangs and the end of the job as vertical lines; the root-cause ``failure`` as a red cross
on its rank. Several files (one per node) are merged by time.

PNG goes through matplotlib's Agg canvas directly (imported only then; no pyplot, no
global backend change). HTML and SVG are written by hand: one self-contained file with
inline SVG and no external assets, with a tooltip on every bar and mark.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from rallypoint.launcher._events import Event, EventLogError, read_events

__all__ = ["Timeline", "build_timeline", "render_report", "report_main"]

STATE_COLORS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "terminated": "#9e9e9e",
    "running": "#1565c0",
}
MARK_STYLES = {  # kind -> (colour, legend label)
    "round": ("#607d8b", "round"),
    "restart": ("#6a1b9a", "restart"),
    "hang": ("#ef6c00", "hang detected"),
    "job_end": ("#000000", "job end"),
}
FAILURE_COLOR = "#b71c1c"
SUFFIXES = (".png", ".html", ".htm", ".svg")


@dataclass(frozen=True, slots=True)
class Bar:
    """One worker lifetime; times are seconds since the timeline's start."""

    rank: int
    start: float
    end: float
    state: str
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


def _state_of(event: Event) -> str:
    state = event.get("state")
    if isinstance(state, str) and state in STATE_COLORS:
        return state
    code = event.get("exitcode")
    return "succeeded" if code == 0 else "failed" if isinstance(code, int) else "terminated"


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
        state = "running" if job_end is None else "terminated"
        note = "still running at the last event" if job_end is None else "no exit recorded"
        begin = start.ts - t0
        bar = Bar(r, begin, max(end, begin), state, f"{_bar_label(start, r)}: {note}")
        timeline.bars.append(bar)
    timeline.ranks = sorted(ranks)
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
        return f"restart {e.get('restart_count', '')}".rstrip() + (f": {reason}" if reason else "")
    if e.kind == "hang":
        idle = e.get("idle_s")
        number = isinstance(idle, int | float) and not isinstance(idle, bool)
        label = "hang" + (f" ({idle:.0f} s without progress)" if number else "")
        return label + (f", {e.get('action')}" if e.get("action") else "")
    status = e.get("status", "")
    return f"job end: {status}".rstrip(": ")


# ---------------------------------------------------------------------------- rendering


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


def _nice_ticks(span: float, target: int = 8) -> list[float]:
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def render_report(events: Sequence[Event], out_path: str | os.PathLike[str]) -> str:
    """Draw the timeline of ``events`` to ``out_path`` (``.png``, ``.html``/``.htm``, ``.svg``).

    Returns the path written. ``ValueError`` for an unknown suffix or no events;
    ``ImportError`` with advice when PNG is asked for without matplotlib.
    """
    path = os.fspath(out_path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"cannot write {path!r}: the output must end in .png, .html or .svg, not {suffix!r}"
        )
    timeline = build_timeline(events)
    if suffix == ".png":
        _render_png(timeline, path)
    else:
        svg = _render_svg(timeline)
        if suffix == ".svg":
            text = svg
        else:
            title = _esc(timeline.title)
            text = (
                "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
                f"<title>{title}</title></head>\n<body style='font-family:sans-serif'>\n"
                f"{svg}\n</body></html>\n"
            )
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return path


_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _esc(text: str) -> str:
    """Escape for XML text and attributes, replacing characters XML cannot hold at all."""
    return html.escape(_NOT_XML.sub("\ufffd", text))


def _render_svg(tl: Timeline) -> str:
    row, left, right, top = 26, 90, 30, 84
    plot_w = 900
    legend_h = 40
    n = max(len(tl.ranks), 1)
    height = top + n * row + 40 + legend_h
    width = left + plot_w + right
    scale = plot_w / tl.span
    y_of = {r: top + i * row for i, r in enumerate(tl.ranks)}
    esc = _esc
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="22" font-size="16" font-weight="bold">{esc(tl.title)}</text>',
    ]
    bottom = top + n * row
    for tick in _nice_ticks(tl.span):
        x = left + tick * scale
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{tick:g}</text>')
    out.append(
        f'<text x="{left + plot_w / 2}" y="{bottom + 32}" text-anchor="middle">'
        "seconds since the first event</text>"
    )
    for r, y in y_of.items():
        out.append(f'<text x="{left - 8}" y="{y + row / 2 + 4}" text-anchor="end">rank {r}</text>')
    for bar in tl.bars:
        x = left + bar.start * scale
        w = max((bar.end - bar.start) * scale, 1.5)
        y = y_of[bar.rank] + 4
        out.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 8}" rx="3" '
            f'fill="{STATE_COLORS[bar.state]}" opacity="0.85">'
            f"<title>{esc(bar.label)}</title></rect>"
        )
    levels = _label_levels(tl)
    for i, mark in enumerate(tl.marks):
        x = left + mark.t * scale
        if mark.rank is None:
            label_y = top - 14 - 12 * levels.get(i, 0)
            color = MARK_STYLES.get(mark.kind, (FAILURE_COLOR, ""))[0]
            dash = ' stroke-dasharray="5,3"' if mark.kind not in ("round", "job_end") else ""
            out.append(
                f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{bottom}" stroke="{color}" '
                f'stroke-width="2"{dash}><title>{esc(mark.label)}</title></line>'
            )
            short = esc(mark.label.split(":")[0].split(" (")[0])
            out.append(
                f'<text x="{x + 3:.1f}" y="{label_y}" fill="{color}" font-size="10">{short}</text>'
            )
        else:
            cy = y_of[mark.rank] + row / 2
            out.append(
                f'<g stroke="{FAILURE_COLOR}" stroke-width="3"><title>{esc(mark.label)}</title>'
                f'<line x1="{x - 6:.1f}" y1="{cy - 6}" x2="{x + 6:.1f}" y2="{cy + 6}"/>'
                f'<line x1="{x - 6:.1f}" y1="{cy + 6}" x2="{x + 6:.1f}" y2="{cy - 6}"/></g>'
            )
    lx, ly = left, height - legend_h + 14
    for state, color in STATE_COLORS.items():
        out.append(f'<rect x="{lx}" y="{ly - 10}" width="14" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 18}" y="{ly}">worker {state}</text>')
        lx += 130
    lx, ly = left, ly + 20
    for color, label in MARK_STYLES.values():
        out.append(
            f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 14}" y2="{ly - 4}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 18}" y="{ly}">{label}</text>')
        lx += 130
    out.append(
        f'<text x="{lx}" y="{ly}" fill="{FAILURE_COLOR}" font-weight="bold">✕</text>'
        f'<text x="{lx + 16}" y="{ly}">root-cause failure</text>'
    )
    out.append("</svg>")
    return "\n".join(out)


def _render_png(tl: Timeline, path: str) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "PNG output needs matplotlib (pip install matplotlib); or write .html instead"
        ) from exc
    n = max(len(tl.ranks), 1)
    fig = Figure(figsize=(11, 1.6 + 0.4 * n), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    y_of = {r: i for i, r in enumerate(tl.ranks)}
    for bar in tl.bars:
        ax.barh(
            y_of[bar.rank],
            max(bar.end - bar.start, tl.span * 0.002),
            left=bar.start,
            height=0.6,
            color=STATE_COLORS[bar.state],
            alpha=0.85,
        )
    levels = _label_levels(tl)
    for i, mark in enumerate(tl.marks):
        if mark.rank is None:
            color = MARK_STYLES.get(mark.kind, (FAILURE_COLOR, ""))[0]
            style = "--" if mark.kind in ("restart", "hang") else "-"
            ax.axvline(mark.t, color=color, linestyle=style, linewidth=1.5)
            short = mark.label.split(":")[0].split(" (")[0]
            ax.annotate(
                short,
                (mark.t, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, 2 + 9 * levels.get(i, 0)),
                textcoords="offset points",
                fontsize=7,
                color=color,
                parse_math=False,
            )
        else:
            ax.plot(mark.t, y_of[mark.rank], marker="x", markersize=11, mew=3, color=FAILURE_COLOR)
    ax.set_yticks(range(len(tl.ranks)), [f"rank {r}" for r in tl.ranks])
    ax.set_ylim(len(tl.ranks) - 0.5, -0.5)
    ax.set_xlim(0, tl.span * 1.02)
    ax.set_xlabel("seconds since the first event")
    ax.set_title(tl.title, loc="left", pad=40, parse_math=False)
    ax.grid(axis="x", color="#eeeeee")
    handles: list[Patch | Line2D] = [
        Patch(color=c, label=f"worker {s}") for s, c in STATE_COLORS.items()
    ]
    handles += [Line2D([], [], color=c, label=label) for c, label in MARK_STYLES.values()]
    handles.append(
        Line2D([], [], color=FAILURE_COLOR, marker="x", mew=3, ls="", label="root-cause failure")
    )
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rallypoint report",
        description="Draw a job's timeline from the JSON-lines files written by "
        "'rallypoint run --events FILE' (one per node, merged by time).",
    )
    parser.add_argument("events", nargs="+", metavar="EVENTS_FILE", help="events file(s)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file: .png (matplotlib), .html or .svg (default: EVENTS_FILE with .html)",
    )
    return parser


def report_main(argv: Sequence[str] | None = None) -> int:
    """``rallypoint report``: exit 0 on success, 2 with a one-line error on bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error
        return int(exc.code) if isinstance(exc.code, int) else 2
    out = args.output or os.path.splitext(args.events[0])[0] + ".html"
    try:
        events = read_events(args.events)
        if not events:
            raise ValueError(f"no events in {', '.join(args.events)}")
        render_report(events, out)
    except (EventLogError, ValueError, ImportError, OSError) as exc:
        message = str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, EventLogError):
            message = f"cannot write {out!r}: {exc.strerror or exc}"
        print(f"rallypoint report: error: {message}", file=sys.stderr)
        return 2
    ranks = len({e.rank if e.rank is not None else e.local_rank for e in events} - {None})
    print(f"wrote {out} ({len(events)} events, {ranks} ranks)")
    return 0
