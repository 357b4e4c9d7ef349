"""One worker stream: its log file gets every byte, the console whole lines, fit for a
terminal and prefixed."""

from __future__ import annotations

import contextlib
from typing import BinaryIO

from rallypoint._core.terminal import LINE_LIMIT, split_clean
from rallypoint._supervise._output._console import write_console
from rallypoint._supervise._output._cpp_stacks import StackFold
from rallypoint._supervise._output._files import Duplicate, write_log

__all__ = ["Sink"]


class Sink:
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
            write_log(self.file, data)
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

    def _emit(self, lines: list[bytes], end: bool = False) -> None:
        """Write whole ``lines`` (without their newlines) to the console; ``end``: the
        stream's last, after which a stack still being folded is said."""
        lines = self.fold.lines(lines) + (self.fold.flush() if end else [])
        if not lines:
            return
        if self.duplicate is not None:
            self.duplicate.copy(self.prefix, lines)
        prefix = self.prefix
        write_console(self.stream, prefix + (b"\n" + prefix).join(lines) + b"\n")

    def close(self) -> None:
        if self.console:
            tail = self.pending or self.dropped
            self._emit(split_clean(self.pending, dropped=self.dropped) if tail else [], end=True)
        self.pending, self.dropped = b"", 0
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
