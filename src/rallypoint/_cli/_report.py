"""``rallypoint report EVENTS [EVENTS ...] [-o OUT.png|OUT.html|OUT.svg]``: a job's timeline.

Several files (one per node) are merged by time; see :func:`rallypoint.observe.render_report`.
Needs matplotlib (``pip install 'rallypoint[plot]'``); without it, one line says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["report_main"]

PROG = "rallypoint report"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Draw a job's timeline from the JSON-lines files written by "
        "'rallypoint run --events FILE' (one per node, merged by time).",
    )
    parser.add_argument("events", nargs="+", metavar="EVENTS_FILE", help="events file(s)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file: .png, .html or .svg (default: EVENTS_FILE with .html)",
    )
    return parser


def report_main(argv: Sequence[str] | None = None) -> int:
    """``rallypoint report``: exit 0 on success, 2 with a one-line error on bad input."""
    from rallypoint.observe import EventLogError, read_events, render_report

    try:
        args = _parser().parse_args(argv)
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
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    ranks = len({e.rank if e.rank is not None else e.local_rank for e in events} - {None})
    print(f"wrote {out} ({len(events)} events, {ranks} ranks)")
    return 0
