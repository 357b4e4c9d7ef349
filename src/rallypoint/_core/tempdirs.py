"""Temporary directories that name their owner, and the removal of those whose owner died.

A launch makes directories in the temp dir: its scratch (``rallypoint_*``), its observer's
stacks (``rallypoint-stacks-*``) and its snapshot server's socket (``rallypoint-snapshots-*``).
It removes them when it ends, and its warm process does when the launcher alone is
killed; a SIGKILL to the launcher's whole process group leaves them behind. So each holds
an :data:`OWNER` file, ``<pid> <start time>`` of the process that made it (the start time
tells a pid that was reused), and the next launch removes those whose owner is gone
(:func:`remove_stale`). A directory without a readable owner file (one being made, or
made by an older version) is never removed: a live process's files must stay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable

from rallypoint._core.procs import pid_alive

__all__ = ["OWNER", "PREFIXES", "make_owned_dir", "mark_owned", "owner_alive", "remove_stale"]

OWNER = ".rallypoint-owner"
PREFIXES = ("rallypoint_", "rallypoint-stacks-", "rallypoint-snapshots-")
"""The names of the directories a launch makes in the temp dir."""


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``); ``None`` when
    there is no such process or it has exited (a zombie that nobody reaped: an orphan
    whose init does not reap), ``"?"`` where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return None
    except OSError:
        return "?" if pid_alive(pid) else None
    fields = stat[stat.rfind(b")") + 2 :].split()  # from field 3, the state
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode() if len(fields) > 19 else "?"  # field 22, starttime


def mark_owned(path: str | os.PathLike[str], pid: int | None = None) -> None:
    """Write ``path``'s :data:`OWNER` file: this process (or ``pid``) made it."""
    pid = os.getpid() if pid is None else pid
    target = os.path.join(path, OWNER)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as fp:
        fp.write(f"{pid} {_start_time(pid) or '?'}\n")
    os.replace(tmp, target)  # a reader never sees half a record


def make_owned_dir(prefix: str, dir: str | None = None) -> str:
    """``tempfile.mkdtemp(prefix=prefix, dir=dir)`` (mode 0700) with its owner file."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    try:
        mark_owned(path)
    except BaseException:  # Ctrl-C too: the directory goes
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def owner_alive(record: str) -> bool:
    """Whether the process an owner record names still runs (``True`` when the record
    cannot be read: nothing is removed on a guess)."""
    parts = record.split()
    if len(parts) != 2 or not parts[0].isdigit():
        return True
    started = _start_time(int(parts[0]))
    if started is None:
        return False
    return "?" in (started, parts[1]) or started == parts[1]


def _stale(path: str) -> bool:
    try:
        with open(os.path.join(path, OWNER)) as fp:
            record = fp.read()
    except OSError:  # no owner file (yet), or not ours to read
        return False
    return not owner_alive(record)


def remove_stale(dirs: Iterable[str], prefixes: tuple[str, ...] = PREFIXES) -> list[str]:
    """Remove the directories named ``prefix*`` right under each of ``dirs`` whose owner
    process is gone; returns their paths."""
    removed = []
    for base in dict.fromkeys(dirs):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            if not name.startswith(prefixes) or os.path.islink(path) or not os.path.isdir(path):
                continue
            if _stale(path):
                with contextlib.suppress(OSError):
                    shutil.rmtree(path)
                    removed.append(path)
    return removed
