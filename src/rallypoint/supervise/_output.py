"""Worker output: line-prefixed console copy and per-rank log files.

The supervisor reads every worker's stdout and stderr pipe in one thread and writes whole
lines only, so lines of different workers never interleave mid-line. Files keep the raw
lines (no prefix) under torchrun's layout ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from string import Template
from typing import BinaryIO

__all__ = ["OutputRouter", "write_console"]

_FLUSH_PARTIAL = 1 << 16


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


class _Sink:
    __slots__ = ("console", "file", "pending", "prefix", "stream")

    def __init__(self, stream: int, prefix: bytes, console: bool, file: BinaryIO | None) -> None:
        self.stream = stream
        self.prefix = prefix
        self.console = console
        self.file = file
        self.pending = b""

    def feed(self, data: bytes) -> None:
        if self.file is not None:
            self.file.write(data)
            self.file.flush()
        if not self.console:
            return
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) < _FLUSH_PARTIAL:
            self.pending = data
            return
        if cut == 0:
            cut = len(data)
        self.pending = data[cut:]
        self._emit(data[:cut])

    def _emit(self, chunk: bytes) -> None:
        if self.prefix:
            lines = chunk.splitlines(keepends=True)
            chunk = b"".join(self.prefix + line for line in lines)
        if not chunk.endswith(b"\n"):
            chunk += b"\n"
        write_console(self.stream, chunk)

    def close(self) -> None:
        if self.console and self.pending:
            self._emit(self.pending)
        self.pending = b""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


class OutputRouter:
    """Routes worker pipes to the console and log files."""

    def __init__(self) -> None:
        self._sinks: dict[int, _Sink] = {}

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
    ) -> None:
        """Start routing ``fd`` (non-blocking read end of a worker's stream)."""
        prefix = b""
        if prefix_template:
            text = Template(prefix_template).safe_substitute(
                rank=rank, local_rank=local_rank, role_name=role
            )
            prefix = text.encode()
        handle: BinaryIO | None = None
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            handle = open(file, "ab")  # noqa: SIM115 - closed in close()
        os.set_blocking(fd, False)
        self._sinks[fd] = _Sink(stream, prefix, console, handle)

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
