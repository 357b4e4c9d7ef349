"""Every worker pipe of an attempt, read on one thread, routed to its :class:`Sink`."""

from __future__ import annotations

import os
from pathlib import Path
from string import Template

from rallypoint._supervise._output._files import Duplicate, open_log
from rallypoint._supervise._output._sink import Sink

__all__ = ["OutputRouter"]


class OutputRouter:
    """Routes worker pipes to the console and log files."""

    def __init__(self) -> None:
        self._sinks: dict[int, Sink] = {}
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
        handle = None if file is None else open_log(file)
        os.set_blocking(fd, False)
        self._sinks[fd] = Sink(stream, prefix, console, handle, duplicate if console else None)

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
