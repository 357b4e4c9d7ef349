"""The launcher's own console: where worker lines and the launcher's lines go."""

from __future__ import annotations

import sys

__all__ = ["write_console"]


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
