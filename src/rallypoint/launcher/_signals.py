"""The agent's signal handling: SIGINT/SIGTERM/... are queued and wake the monitor loop."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["install_signal_handlers", "restore_signal_handlers"]


def install_signal_handlers(
    names: str, queue: list[int]
) -> tuple[int | None, dict[int, Any] | None]:
    """Queue the signals named in ``names`` (``"SIGTERM,SIGINT"``) into ``queue``.

    Returns the read end of a wake-up pipe (readable after any signal) and what
    :func:`restore_signal_handlers` needs; ``(None, None)`` outside the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return None, None
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old: dict[int, Any] = {-1: signal.set_wakeup_fd(w), -2: (r, w)}
    for name in (n.strip() for n in names.split(",")):
        if name:
            signum = int(getattr(signal, name))
            old[signum] = signal.signal(signum, lambda s, _f: queue.append(s))
    return r, old


def restore_signal_handlers(old: dict[int, Any] | None) -> None:
    """Undo :func:`install_signal_handlers`."""
    if old is None:
        return
    r, w = old.pop(-2)
    signal.set_wakeup_fd(old.pop(-1))
    for signum, handler in old.items():
        signal.signal(signum, handler)
    os.close(r)
    os.close(w)
