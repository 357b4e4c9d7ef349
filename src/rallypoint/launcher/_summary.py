"""The failure screen printed (and raised) when a job fails."""

from __future__ import annotations

import os
import signal
import textwrap
from datetime import datetime

from rallypoint.launcher._errors import WorkerState

__all__ = ["describe_status", "format_summary"]

_WIDTH = 72


def describe_status(status: int) -> tuple[int, str]:
    """Turn a ``waitpid`` status into ``(returncode, text)``; returncode < 0 for signals."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return code, _signal_text(-code)
    return code, f"exited with {code}"


def _signal_text(signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by {name}"


def format_summary(
    *,
    title: str,
    root: WorkerState,
    host: str,
    when: float,
    elapsed: float,
    traceback_text: str,
    others: list[WorkerState],
    attempts: str,
) -> str:
    """One screen: the root cause with its traceback, then one line per other rank."""
    rule = "=" * _WIDTH
    stamp = datetime.fromtimestamp(when).isoformat(sep=" ", timespec="milliseconds")
    lines = [
        rule,
        f"{title} FAILED ({attempts})",
        "-" * _WIDTH,
        "Root cause (first failure):",
        f"  rank      : {root.rank} (local_rank: {root.local_rank})",
        f"  host      : {host}",
        f"  pid       : {root.pid}",
        f"  exitcode  : {root.exitcode} ({root.detail})",
        f"  time      : {stamp} ({elapsed:.2f} s after start)",
    ]
    tb = traceback_text.rstrip()
    if tb:
        tb_lines = tb.splitlines()
        if len(tb_lines) > 40:
            tb_lines = [*tb_lines[:8], "  ...", *tb_lines[-30:]]
        lines.append("  traceback :")
        lines.extend(textwrap.indent("\n".join(tb_lines), "    ").splitlines())
    else:
        lines.append("  traceback : (none: the worker died without raising a Python exception)")
    if others:
        lines.append("Other ranks:")
        for w in sorted(others, key=lambda w: w.rank):
            lines.append(f"  rank {w.rank} (local_rank: {w.local_rank}, pid {w.pid}): {w.detail}")
    lines.append(rule)
    return "\n".join(lines)
