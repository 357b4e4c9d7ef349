"""Whether torch's OpenMP threads still work in a process forked from this one.

GNU OpenMP (torch's intra-op threads on Linux) is not fork-safe: once this process has run
a parallel CPU op, its thread team exists, and a forked child that runs a parallel op of
its own waits forever for team threads that were not copied. ``launch(fn)`` forks its
workers from a copy of the calling process, so a program that trained or evaluated a
model before calling it would hang in its workers' first large op.

:func:`openmp_survives_fork` asks the kernel rather than guessing: it forks a child that
runs one parallel op with ``threads`` threads and waits a short while for it to exit. A
broken team stays broken, so that answer is kept for the life of the process.
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["openmp_survives_fork"]

_PROBE_ELEMENTS = 1 << 18  # well above torch's grain size (32,768): the op runs in parallel
_broken_in: set[int] = set()  # pids whose team a probe found broken (a fork keeps the set)


def openmp_survives_fork(threads: int, timeout: float = 1.0) -> bool:
    """Whether a child forked now can run a parallel torch op with ``threads`` threads.

    True without a probe when torch is not imported yet (then nothing can be broken) or
    ``threads`` is 1 (no team is used). A healthy probe takes about 10 ms; a probe still
    running after ``timeout`` counts as hung (then the workers merely get one thread).
    """
    torch = sys.modules.get("torch")
    if torch is None or threads <= 1:
        return True
    if os.getpid() in _broken_in:
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns here
        code = 1
        try:
            torch.set_num_threads(threads)
            torch.ones(_PROBE_ELEMENTS).mul_(2.0)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    _broken_in.add(os.getpid())
    return False
