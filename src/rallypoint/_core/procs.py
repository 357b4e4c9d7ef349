"""Process helpers that need no third-party package."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["exit_now", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie counts; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_now(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process with ``code`` without interpreter finalization.

    For command-line entry points that may leave daemon threads inside torch's C++ store
    calls (rendezvous heartbeats, a blocked ``next_rendezvous``): when such a thread wakes
    up during finalization it cannot take the GIL back, and unwinding through pybind11's
    ``noexcept`` GIL guard aborts the process (``terminate called without an active
    exception``, exit status -6) after the job itself succeeded.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
