"""What a failed worker left behind, the failure screen printed (and raised) for it, and
the line that says what an in-process restart kept and replaced."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import textwrap
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from rallypoint._core.status import WorkerStatus
from rallypoint._supervise._errors import WorkerSummary

__all__ = [
    "bad_target_message",
    "describe_status",
    "error_info",
    "fatal_message",
    "format_summary",
    "stopped_with_the_job",
]

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


STOPPED_WITH_THE_JOB = "stopped by rallypoint: the job failed before its in-process restart"


def stopped_with_the_job(workers: list[WorkerSummary]) -> list[WorkerSummary]:
    """The other ranks of a failed job as its summary tells them: a worker kept for an
    in-process restart that will not come is stopped with the job (before the summary is
    shown: ``Supervisor.stop_kept``)."""
    return [
        replace(w, state=WorkerStatus.TERMINATED, detail=STOPPED_WITH_THE_JOB)
        if w.state is WorkerStatus.KEPT
        else w
        for w in workers
    ]


def format_summary(
    *,
    title: str,
    root: WorkerSummary,
    host: str,
    when: float,
    elapsed: float,
    traceback_text: str,
    others: list[WorkerSummary],
    attempts: str,
    culprit: str = "",
) -> str:
    """One screen: the root cause with its traceback, then one line per other rank.
    ``culprit``: the rank the first failure waited for, when a collective timed out."""
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
    if culprit:  # the first failure is a victim: name what it waited for
        lines.append(f"  waited for: {culprit} (Flight Recorder; the report above)")
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


_SUPERVISE_DIR = os.path.dirname(os.path.abspath(__file__))


def _trim_fault(text: str) -> str:
    """faulthandler's dump without the launcher's own frames and the module list."""
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Extension modules:"):
            continue
        if stripped.startswith("File ") and (
            "<frozen runpy>" in stripped
            or _SUPERVISE_DIR in stripped
            or "rallypoint/__main__.py" in stripped
            or "rallypoint/_cli/_main.py" in stripped
            or "/bin/rallypoint" in stripped
        ):
            continue
        keep.append(line)
    return "\n".join(keep).strip()


def error_info(result: bytes, error_file: Path) -> tuple[str, BaseException | None]:
    """A failed worker's traceback and exception.

    From its result pipe (``launch()`` workers), else ``TORCHELASTIC_ERROR_FILE`` (ours or
    torch's ``@record``), plus faulthandler's dump for fatal signals.
    """
    tb, exc = "", None
    if len(result) > 8:
        with contextlib.suppress(Exception):
            msg = pickle.loads(result[8:])
            if msg[0] == "err":
                tb = msg[2]
                if msg[1] is not None:
                    exc = pickle.loads(msg[1])
    if not tb:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            message = json.loads(error_file.read_text())["message"]
            if isinstance(message, str):
                tb = message
            else:
                tb = message["extraInfo"]["py_callstack"] or message["message"]
    with contextlib.suppress(OSError):
        fault = _trim_fault(Path(f"{error_file}.fault").read_text())
        if fault:
            tb = f"{tb}\n{fault}" if tb else fault
    return tb, exc


def fatal_message(error_file: Path) -> str:
    """The message of the ``FatalError`` the worker raised, or ``""``."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads(error_file.read_text())["rallypoint"]["fatal"])
    return ""


def bad_target_message(error_file: Path) -> str:
    """The worker's "cannot start the target" message, or ``""``."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads(error_file.read_text())["rallypoint"]["bad_target"])
    return ""
