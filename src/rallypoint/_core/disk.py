"""Disk trouble that must not end a healthy job: a full, failing or read-only directory.

Writers of worker logs and snapshots keep going when their directory fails (the console
and memory still have the data); :class:`DiskTrouble` says so on stderr in one line that
names the directory, what failed and the free space left, at most once a minute per
filesystem, so a disk that stays full does not flood the screen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path

from rallypoint._core.throttle import Throttle

__all__ = ["DiskTrouble", "check_writable", "format_free", "free_bytes", "free_space"]

REPEAT_SECONDS = 60.0


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes free on the filesystem of ``path`` (or its nearest existing parent); ``OSError``
    when that cannot be read."""
    return shutil.disk_usage(_existing(path)).free


def format_free(free: int) -> str:
    """``"1.2 GiB free"``."""
    size = float(free)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit} free" if unit == "B" else f"{size:.1f} {unit} free"
        size /= 1024
    raise AssertionError("unreachable")


def free_space(path: str | os.PathLike[str]) -> str:
    """``"1.2 GiB free"`` on the filesystem of ``path`` (or its nearest existing parent)."""
    try:
        return format_free(free_bytes(path))
    except OSError:
        return "free space unknown"


def check_writable(directory: str | os.PathLike[str], option: str) -> Path:
    """Create ``directory`` (and parents) if needed and check that files can be made in it.

    Raises ``ValueError`` naming ``option`` when it cannot: the one line a user sees at
    start instead of a failure mid-run.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".rallypoint-probe-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"{option} {path}: cannot write there ({exc.strerror or exc}); "
            "pass a writable directory"
        ) from None
    return path


def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _filesystem(path: str | os.PathLike[str]) -> str | int:
    """What one line per minute is counted for: the filesystem (every rank's directory on a
    full disk fails alike), or the path itself where it cannot be told."""
    try:
        return os.stat(_existing(path)).st_dev
    except OSError:
        return str(path)


class DiskTrouble:
    """Reports failed writes, one line per filesystem per minute."""

    def __init__(self, what: str, consequence: str, every: float = REPEAT_SECONDS) -> None:
        self.what = what
        """What is written there (``"worker logs"``)."""
        self.consequence = consequence
        """What happens instead (``"output still goes to the console"``)."""
        self._throttle = Throttle(every)

    def report(self, directory: str | os.PathLike[str], action: str, exc: OSError) -> bool:
        """Say that ``action`` failed under ``directory`` unless a line was said for its
        filesystem within the last minute; returns whether a line was written."""
        if not self._throttle.ready(_filesystem(directory)):
            return False
        reason = exc.strerror or str(exc)
        line = (
            f"rallypoint: cannot write {self.what} under {directory}: {action} failed "
            f"({reason}; {free_space(directory)}); {self.consequence}\n"
        )
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.write(line)
            sys.stderr.flush()
        return True
