"""Worker log files, and torchrun's duplicate filters' ``filtered_*.log``; a file that
cannot be written is said once a minute and never stops the job."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import BinaryIO

from rallypoint._core.disk import DiskTrouble

__all__ = ["LOG_TROUBLE", "Duplicate", "open_log", "write_log"]

LOG_TROUBLE = DiskTrouble("worker logs", "the job goes on, and so does its console output")


def open_log(path: Path) -> BinaryIO | None:
    """``path`` opened for appending, unbuffered; ``None`` (said once a minute) if it fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab", buffering=0)
    except OSError as exc:
        LOG_TROUBLE.report(path.parent, f"opening {path.name}", exc)
        return None


def write_log(file: BinaryIO, data: bytes) -> None:
    """Append ``data`` to ``file``; a failed write is said (once a minute) and dropped."""
    try:
        file.write(data)
    except OSError as exc:
        LOG_TROUBLE.report(Path(file.name).parent, f"writing {Path(file.name).name}", exc)


class Duplicate:
    """One attempt's ``filtered_stdout.log`` (or stderr): the lines that contain a filter."""

    __slots__ = ("file", "needles")

    def __init__(self, path: Path, filters: tuple[str, ...]) -> None:
        with contextlib.suppress(OSError):
            path.unlink()  # "wb" as torchrun, but appends need no seek on a failing disk
        self.file = open_log(path)
        self.needles = tuple(f.encode() for f in filters)

    def copy(self, prefix: bytes, lines: list[bytes]) -> None:
        """Copy those of ``lines`` (without their newlines) that contain a filter."""
        if self.file is None:
            return
        kept = [prefix + line + b"\n" for line in lines if any(n in line for n in self.needles)]
        if kept:
            write_log(self.file, b"".join(kept))

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
