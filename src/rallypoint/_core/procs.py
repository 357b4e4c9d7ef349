"""Process helpers that need no third-party package."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import NoReturn

__all__ = [
    "become_subreaper",
    "descendants",
    "exit_now",
    "kill_descendants",
    "pid_alive",
    "pid_running",
    "set_parent_death_signal",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie counts; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live process: like :func:`pid_alive`, but a zombie (exited, not
    yet reaped) does not count. Without ``/proc``, as :func:`pid_alive`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        return pid_alive(pid)
    state = stat[stat.rfind(b")") + 2 :][:1]  # the field after "(command)"
    return state not in (b"Z", b"X")


def exit_now(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process with ``code`` without interpreter finalization.

    For command-line entry points that may leave daemon threads inside torch's C++ store
    calls (rendezvous heartbeats, a blocked ``next_rendezvous``): when such a thread wakes
    up during finalization it cannot take the GIL back, and unwinding through pybind11's
    ``noexcept`` GIL guard aborts the process (``terminate called without an active
    exception``, exit status -6) after the job itself succeeded. Skipping the shutdown of
    an interpreter with torch loaded also saves about a second of CPU, during which a
    stopped launcher would still be there.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def set_parent_death_signal(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies (best effort)."""
    import ctypes  # here: not on the launcher's path to forking its warm process

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans among its
    descendants (a child that daemonized, or left its session with ``setsid``, and whose
    parent exited) become its children instead of PID 1's. Returns whether it worked."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except Exception:
        return False


def _parents() -> dict[int, tuple[int, bool]]:
    """Every process's parent, and whether it is a zombie, from ``/proc/PID/stat``."""
    out: dict[int, tuple[int, bool]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as fp:
                stat = fp.read()
            state, ppid = stat[stat.rindex(b")") + 2 :].split()[:2]
            out[int(name)] = (int(ppid), state == b"Z")
    return out


def descendants(pid: int) -> list[int]:
    """The living (not zombie) descendants of ``pid``, from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    zombies = set()
    for child, (parent, zombie) in _parents().items():
        children.setdefault(parent, []).append(child)
        if zombie:
            zombies.add(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in zombies:
            out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_descendants(timeout: float) -> bool:
    """SIGKILL every descendant of this process and reap this process's children, until none
    is left or ``timeout`` seconds passed; returns whether none is left.

    Meant for a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of its descendants
    become its children, so a descendant that forks, daemonizes or starts its own session
    while this runs is found on the next pass.
    """
    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        family = descendants(me)
        for pid in family:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not family:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
