"""The request FIFO of a worker (``$RALLYPOINT_STACKS_DIR/<pid>.fr``): the agent writes one
line per request; the worker's Flight Recorder thread (``_flight._recorder``) reads and
answers it."""

from __future__ import annotations

import os

__all__ = ["STACKS_REQUEST", "ask", "fifo_path"]

STACKS_REQUEST = "stacks"
"""The request line for a stack dump (the answer goes to ``<pid>.stacks``: ``_stacks``)."""


def fifo_path(directory: str | os.PathLike[str], pid: int) -> str:
    return os.path.join(os.fspath(directory), f"{pid}.fr")


def ask(directory: str | os.PathLike[str], pid: int, line: str) -> str | None:
    """Write ``line`` into worker ``pid``'s FIFO without blocking: ``None`` once written,
    else why not (no reader: recording off, still starting, or exited)."""
    try:
        fd = os.open(fifo_path(directory, pid), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return "no Flight Recorder dumper (recording off, or still starting)"
    try:
        os.write(fd, f"{line}\n".encode())
    except OSError as exc:
        return f"cannot ask it: {exc.strerror}"
    finally:
        os.close(fd)
    return None
