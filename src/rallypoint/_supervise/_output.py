"""Worker output: line-prefixed console copy and per-rank log files.

The supervisor reads every worker's stdout and stderr pipe in one thread and writes whole
lines only, so lines of different workers never interleave. Files keep the raw lines
under torchrun's layout ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/``; the console gets them
prefixed and fit for a terminal (``rallypoint._core.terminal``), and the lines matching
torchrun's duplicate filters are also copied to ``filtered_*.log`` (:class:`Duplicate`); a
c10d warning's C++ stack is one line there (``_cpp_stacks``).
A log file that cannot be written never stops the job: the console copy goes on, and
:data:`LOG_TROUBLE` says which directory failed, at most once a minute.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from string import Template
from typing import BinaryIO

from rallypoint._core.disk import DiskTrouble
from rallypoint._core.terminal import LINE_LIMIT, split_clean
from rallypoint._supervise._cpp_stacks import StackFold

__all__ = ["LOG_TROUBLE", "Duplicate", "OutputRouter", "write_console"]

LOG_TROUBLE = DiskTrouble("worker logs", "the job goes on, and so does its console output")


def _open_log(path: Path) -> BinaryIO | None:
    """``path`` opened for appending, unbuffered; ``None`` (said once a minute) if it fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab", buffering=0)
    except OSError as exc:
        LOG_TROUBLE.report(path.parent, f"opening {path.name}", exc)
        return None


def _write_log(file: BinaryIO, data: bytes) -> None:
    """Append ``data`` to ``file``; a failed write is said (once a minute) and dropped."""
    try:
        file.write(data)
    except OSError as exc:
        LOG_TROUBLE.report(Path(file.name).parent, f"writing {Path(file.name).name}", exc)


def write_console(stream: int, data: bytes) -> None:
    """Write ``data`` to the launcher's stdout (1) or stderr (2), whatever they are now."""
    target = sys.stdout if stream == 1 else sys.stderr
    if target is None:
        return
    buf = getattr(target, "buffer", None)
    try:
        if buf is not None:
            target.flush()
            buf.write(data)
            buf.flush()
        else:
            target.write(data.decode("utf-8", "replace"))
            target.flush()
    except (OSError, ValueError):
        pass  # the console went away (closed pipe); files still get everything


class Duplicate:
    """One attempt's ``filtered_stdout.log`` (or stderr): the lines that contain a filter."""

    __slots__ = ("file", "needles")

    def __init__(self, path: Path, filters: tuple[str, ...]) -> None:
        with contextlib.suppress(OSError):
            path.unlink()  # "wb" as torchrun, but appends need no seek on a failing disk
        self.file = _open_log(path)
        self.needles = tuple(f.encode() for f in filters)

    def copy(self, prefix: bytes, lines: list[bytes]) -> None:
        """Copy those of ``lines`` (without their newlines) that contain a filter."""
        if self.file is None:
            return
        kept = [prefix + line + b"\n" for line in lines if any(n in line for n in self.needles)]
        if kept:
            _write_log(self.file, b"".join(kept))

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None


class _Sink:
    __slots__ = (
        "console",
        "dropped",
        "duplicate",
        "file",
        "fold",
        "pending",
        "prefix",
        "stream",
    )

    def __init__(
        self,
        stream: int,
        prefix: bytes,
        console: bool,
        file: BinaryIO | None,
        duplicate: Duplicate | None = None,
    ) -> None:
        self.stream = stream
        self.prefix = prefix
        self.console = console
        self.file = file
        self.duplicate = duplicate  # only for a stream that goes to the console too
        self.pending = b""
        """The start of a line still coming (at most ``LINE_LIMIT`` bytes of it)."""
        self.dropped = 0
        """Bytes of that line cut already."""
        self.fold = StackFold()

    def feed(self, data: bytes) -> None:
        if self.file is not None:
            _write_log(self.file, data)
        if not self.console:
            return
        end = data.rfind(b"\n")
        if end < 0:
            self._grow(data)
            return
        lines = split_clean(self.pending + data[:end], dropped=self.dropped)
        self.pending, self.dropped = b"", 0
        self._emit(lines)
        self._grow(data[end + 1 :])

    def _grow(self, data: bytes) -> None:
        """Add ``data`` (no newline) to the line still coming: what a carriage return
        overwrites is forgotten, and what goes beyond ``LINE_LIMIT`` counted and cut."""
        line = self.pending + data
        cr = line.rfind(b"\r", 0, len(line) - 1)  # one at the end may start "\r\n"
        if cr >= 0:
            line, self.dropped = line[cr + 1 :], 0
        if len(line) > LINE_LIMIT + 1:
            self.dropped += len(line) - LINE_LIMIT - 1
            line = line[: LINE_LIMIT + 1]  # one more than shown: clean_line cuts and counts
        self.pending = line

    def _emit(self, lines: list[bytes]) -> None:
        """Write whole ``lines`` (without their newlines) to the console."""
        lines = self.fold.lines(lines)
        if not lines:
            return
        if self.duplicate is not None:
            self.duplicate.copy(self.prefix, lines)
        prefix = self.prefix
        write_console(self.stream, prefix + (b"\n" + prefix).join(lines) + b"\n")

    def close(self) -> None:
        if self.console and (self.pending or self.dropped):
            self._emit(split_clean(self.pending, dropped=self.dropped))
        if self.console and (note := self.fold.flush()):
            write_console(self.stream, self.prefix + note[0] + b"\n")
        self.pending, self.dropped = b"", 0
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


class OutputRouter:
    """Routes worker pipes to the console and log files."""

    def __init__(self) -> None:
        self._sinks: dict[int, _Sink] = {}
        self._duplicates: list[Duplicate] = []

    def duplicate(self, path: Path, filters: tuple[str, ...]) -> Duplicate:
        """Open ``path`` for the lines that contain one of ``filters`` (closed by :meth:`close`)."""
        dup = Duplicate(path, filters)
        self._duplicates.append(dup)
        return dup

    def add(
        self,
        fd: int,
        *,
        stream: int,
        prefix_template: str | None,
        rank: int,
        local_rank: int,
        role: str,
        console: bool,
        file: Path | None,
        duplicate: Duplicate | None = None,
    ) -> None:
        """Start routing ``fd`` (non-blocking read end of a worker's stream); ``duplicate``
        gets a copy of its console lines that match (torchrun's duplicate filters)."""
        prefix = b""
        if prefix_template:
            text = Template(prefix_template).safe_substitute(
                rank=rank, local_rank=local_rank, role_name=role
            )
            prefix = text.encode()
        handle = None if file is None else _open_log(file)
        os.set_blocking(fd, False)
        self._sinks[fd] = _Sink(stream, prefix, console, handle, duplicate if console else None)

    def fds(self) -> list[int]:
        return list(self._sinks)

    def on_readable(self, fd: int) -> bool:
        """Read what ``fd`` has; returns ``False`` (and closes it) at end of file."""
        sink = self._sinks[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            sink.feed(data)
            return True
        sink.close()
        del self._sinks[fd]
        os.close(fd)
        return False

    def release(self, fd: int) -> None:
        """Stop routing ``fd`` without closing it: its worker is kept for the next attempt,
        whose router takes it (a line it has not finished is shown now)."""
        self._sinks.pop(fd).close()

    def close(self) -> None:
        """Drain what is left without blocking, then close everything."""
        for fd in list(self._sinks):
            while fd in self._sinks:
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    data = b""
                if not data:
                    self._sinks.pop(fd).close()
                    os.close(fd)
                else:
                    self._sinks[fd].feed(data)
        for dup in self._duplicates:
            dup.close()
