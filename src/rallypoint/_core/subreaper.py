"""Run one command so that nothing it starts outlives it.

``python -m rallypoint._core.subreaper PARENT_PID -- ARGV...`` runs ``ARGV`` as its child
and is a child subreaper, as the warm process is for the workers: whatever the command
starts stays a descendant, even what leaves its session or daemonizes. When the command
exits, this process is told to stop, or its parent dies, it kills the command and every
descendant, reaps them and exits as the command did (:func:`main`). The health checks run
through it (``rallypoint._elastic._health._check_run``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from typing import NoReturn

from rallypoint._core.procs import become_subreaper, kill_descendants, set_parent_death_signal

__all__ = ["KILL_TIMEOUT", "argv_for", "main"]

KILL_TIMEOUT = 2.0
"""Seconds spent killing the command's descendants (a fork bomb keeps making more)."""
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def argv_for(command: list[str]) -> list[str]:
    """The argv that runs ``command`` under this module, for a child of this process."""
    return [sys.executable, "-m", __name__, str(os.getpid()), "--", *command]


class _Command:
    """The command's pid while it runs; a stop signal kills it (the rest follows)."""

    def __init__(self) -> None:
        self.pid = 0
        self.stopped = False

    def on_signal(self, _signum: int, _frame: object) -> None:
        self.stopped = True
        if self.pid:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)

    def run(self, argv: list[str]) -> int:
        """Run ``argv`` to its end; its ``returncode`` (negative: killed by a signal)."""
        try:
            proc = subprocess.Popen(argv, process_group=0)
        except OSError as exc:
            sys.stderr.write(f"{argv[0]}: {exc.strerror or exc}\n")
            return 127
        self.pid = proc.pid
        if self.stopped:  # signalled before the pid was known
            self.on_signal(0, None)
        code = proc.wait()
        self.pid = 0
        return code


def _exit_as(code: int) -> NoReturn:
    """End this process as the command ended: its exit code, or its signal (no core)."""
    sys.stderr.flush()
    if code < 0:
        with contextlib.suppress(Exception):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(Exception):  # not for SIGKILL, which has no handler
            signal.signal(-code, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code & 0xFF)


def main(argv: list[str]) -> NoReturn:
    """``PARENT_PID -- ARGV...``: run ``ARGV`` under this child subreaper.

    On the command's exit, on SIGTERM, SIGINT or SIGHUP (a timeout, a signal to the
    launcher), or when the parent dies (``PR_SET_PDEATHSIG``), SIGKILL the command and every
    descendant found in ``/proc`` (:func:`~rallypoint._core.procs.kill_descendants`), reap
    them and exit as the command did. If ``PARENT_PID`` died before the parent-death signal
    was armed, the command never runs.
    """
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: python -m rallypoint._core.subreaper PARENT_PID -- ARGV...\n")
        os._exit(2)
    command = _Command()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, command.on_signal)
    set_parent_death_signal(signal.SIGTERM)
    become_subreaper()
    code = -signal.SIGKILL
    try:
        if os.getppid() == int(argv[0]):  # else its parent died before the signal was armed
            code = command.run(argv[2:])
    finally:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        kill_descendants(KILL_TIMEOUT)
    _exit_as(code)


if __name__ == "__main__":
    main(sys.argv[1:])
