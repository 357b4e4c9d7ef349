"""Stacks for people: one line per stack, and ranks grouped by identical main-thread stacks.

:func:`format_grouped_stacks` turns the dumps of many workers (any nodes) into::

    ranks 0,2,3: all_reduce at train.py:42
    rank 1: sleep at train.py:17

each followed once by the full stack with source lines. :func:`stack_summary` names what the
innermost user frame is waiting in.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Mapping
from typing import Any

from rallypoint._core.frames import is_library
from rallypoint._core.ranks import ranks_text
from rallypoint._watch._stacks import Frame, StackDump, ThreadStack

__all__ = [
    "FULL_STACKS_ENV",
    "format_frames",
    "format_grouped_stacks",
    "stack_summary",
    "user_frames",
]

FULL_STACKS_ENV = "RALLYPOINT_FULL_STACKS"
"""Set to 1 to keep the launcher's own frames (rallypoint, runpy) at the base of stacks."""


_WRAPPER_NAMES = frozenset(
    {"wrapper", "inner", "wrapped", "_fn", "decorate_context", "<lambda>", "<genexpr>", "__call__"}
)


def _called_in(source: str) -> str | None:
    """The outermost call's name in a line of source (``dist.all_reduce(t)`` → ``all_reduce``)."""
    try:
        tree = ast.parse(source.rstrip(":").strip() or "pass")
    except SyntaxError:
        m = re.search(r"([A-Za-z_]\w*)\s*\(", source)
        return m.group(1) if m else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                return func.attr
            if isinstance(func, ast.Name):
                return func.id
    return None


def stack_summary(frames: tuple[Frame, ...]) -> str:
    """One line for a stack (innermost first): what the innermost user frame is waiting in.

    ``all_reduce at train.py:42`` when user code called into a library; for a frame blocked
    in C (``time.sleep``), the call named on its source line; ``in f at x.py:3`` otherwise.
    """
    if not frames:
        return "no Python frames"
    user = next((i for i, f in enumerate(frames) if not is_library(f.filename)), None)
    if user is None:
        f = frames[0]
        return f"{f.name} at {os.path.basename(f.filename)}:{f.lineno}"
    at = f"{os.path.basename(frames[user].filename)}:{frames[user].lineno}"
    for callee in reversed(frames[:user]):  # from the frame user code called, inwards
        if callee.name not in _WRAPPER_NAMES and not re.match(r"_[^_]", callee.name):
            return f"{callee.name} at {at}"
    if user > 0:
        return f"{frames[user - 1].name} at {at}"
    called = _called_in(frames[user].source) if frames[user].source else None
    if called is not None:
        return f"{called} at {at}"
    return f"in {frames[user].name} at {at}"


def user_frames(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """``frames`` (innermost first) without the launcher's frames below the user's first.

    A worker's stack starts in rallypoint (the warm process, the worker bootstrap) and
    runpy; everything outside the user's outermost frame goes, unless
    ``RALLYPOINT_FULL_STACKS=1``. A stack with no user frame is kept whole.
    """
    if os.environ.get(FULL_STACKS_ENV, "") not in ("", "0"):
        return frames
    outermost_user = next(
        (i for i in range(len(frames) - 1, -1, -1) if not is_library(frames[i].filename)), None
    )
    return frames if outermost_user is None else frames[: outermost_user + 1]


def _ours(thread: ThreadStack) -> bool:
    """rallypoint's own helper threads in a worker (the Flight Recorder dumper)."""
    dumper = os.path.join("_flight", "_recorder.py")
    return any(f.name == "_serve" and f.filename.endswith(dumper) for f in thread.frames)


def format_frames(frames: tuple[Frame, ...], indent: str) -> list[str]:
    """``frames`` (innermost first) as a traceback prints them: most recent call last."""
    out = []
    for f in reversed(frames):  # traceback order: most recent call last
        out.append(f'{indent}File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.source:
            out.append(f"{indent}  {f.source}")
    return out


def format_grouped_stacks(stacks_by_rank: Mapping[int, StackDump]) -> str:
    """Group ranks (global, across nodes) whose main-thread stacks are identical.

    One headline per group (``ranks 0,2,3: all_reduce at train.py:42``), the hosts and
    pids, then the group's full main-thread stack once (most recent call last) and the
    innermost frame of each other thread. Workers without a dump are grouped by reason.
    Stacks start at the user's code (:func:`user_frames`).
    """
    groups: dict[tuple[Any, ...], list[StackDump]] = {}
    for rank in sorted(stacks_by_rank):
        dump = stacks_by_rank[rank]
        main = dump.main
        if dump.error is not None or main is None:
            key: tuple[Any, ...] = ("error", dump.error or "empty dump")
        else:
            key = ("stack", tuple((f.filename, f.lineno, f.name) for f in user_frames(main.frames)))
        groups.setdefault(key, []).append(dump)
    lines: list[str] = []
    for key, dumps in groups.items():
        ranks = [d.rank for d in dumps]
        first = dumps[0]
        main = first.main
        if key[0] == "error" or main is None:
            lines.append(f"{ranks_text(ranks)}: no stack: {key[1]}")
        else:
            lines.append(f"{ranks_text(ranks)}: {stack_summary(main.frames)}")
        by_host: dict[str, list[str]] = {}
        for d in dumps:
            by_host.setdefault(d.host, []).append(
                f"{d.rank}" + (f" (pid {d.pid})" if d.pid else "")
            )
        lines.append("  on " + "; ".join(f"{h}: {', '.join(rs)}" for h, rs in by_host.items()))
        if key[0] == "stack" and main is not None:
            lines.append("  Stack (most recent call last):")
            lines.extend(format_frames(user_frames(main.frames), "    "))
            others = [t for t in first.threads if t is not main and not _ours(t)]
            for t in others:
                where = stack_summary(t.frames) if t.frames else "no Python frames"
                lines.append(f"  other thread {t.thread_id}: {where}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n" if lines else ""
