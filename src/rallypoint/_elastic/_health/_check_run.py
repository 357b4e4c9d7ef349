"""Running one health check: a command bounded in time that leaves nothing behind.

:class:`CheckResult` is how a check ended and :class:`HealthContext` what the built-in
checks look at on this node; the checks themselves are in ``_builtin_checks``, the list
a node runs and the failure screen in ``_checks``.

A command runs under a child subreaper of its own (``rallypoint._core.subreaper``), so
that everything it started is killed when it exits, times out or the launcher goes, also
what left its session or daemonized. The tail of its output is read back fit for a
terminal (``rallypoint._core.terminal``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from rallypoint._core.subreaper import KILL_TIMEOUT, argv_for
from rallypoint._core.terminal import split_clean

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = ["CheckResult", "HealthContext", "run_command"]

POLL_EVERY = 0.05
STOP_WAIT = KILL_TIMEOUT + 3.0
"""Seconds a stopped check's subreaper has to kill what the check started and exit."""
OUTPUT_TAIL = 64 * 1024
"""Bytes of the end of a check's output read back."""
OUTPUT_LINE_LIMIT = 1024
"""Bytes of each line of that output kept (the screen shows the last lines)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """How one check ended."""

    check: str
    ok: bool
    seconds: float
    exitcode: int | None = None
    timed_out: bool = False
    output: str = ""
    """What it printed (a command), or what failed (a built-in)."""
    skipped: str = ""
    """Why it did not run here (``ok`` is True then)."""


@dataclass(slots=True)
class HealthContext:
    """What the built-in checks look at on this node."""

    directories: tuple[tuple[str, str], ...] = ()
    """``(what, path)`` pairs for ``builtin:disk`` (``("--log-dir", "/logs")``)."""
    store: Callable[[], Store | None] = lambda: None
    """The rendezvous store for ``builtin:store`` (``None``: none here)."""
    poll: Callable[[], None] = lambda: None
    """Called while a check runs; raises to stop (a signal to the launcher)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of command checks."""


def run_command(
    command: str,
    timeout: float,
    *,
    poll: Callable[[], None] = lambda: None,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
) -> CheckResult:
    """``/bin/sh -c command`` (or ``argv``) with its output in a temporary file, killed with
    everything it started when it ends or after ``timeout`` seconds; ``poll()`` may raise
    to stop it."""
    started = time.monotonic()
    with _output_file() as out:
        proc = subprocess.Popen(
            argv_for(argv or ["/bin/sh", "-c", command]),
            stdin=subprocess.DEVNULL,
            stdout=out or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        timed_out = False
        try:
            while proc.poll() is None:
                if time.monotonic() - started >= timeout:
                    timed_out = True
                    break
                poll()
                time.sleep(POLL_EVERY)
        finally:
            if proc.poll() is None:
                _stop(proc)
        elapsed = time.monotonic() - started
        text = _read(out)
    code = None if timed_out else proc.returncode
    return CheckResult(
        check=command,
        ok=code == 0,
        seconds=elapsed,
        exitcode=code,
        timed_out=timed_out,
        output=text,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Have the check's subreaper kill all the check started; SIGKILL it if it cannot."""
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _output_file() -> Iterator[IO[bytes] | None]:
    """A temporary file for a check's output, or ``None`` where none can be made (a full or
    read-only temp dir must not stop the check itself)."""
    try:
        fp = tempfile.TemporaryFile()  # noqa: SIM115  # closed below
    except OSError:
        yield None
        return
    with fp:
        yield fp


def _read(fp: IO[bytes] | None) -> str:
    """The end of the output in ``fp``, fit for a terminal."""
    if fp is None:
        return ""
    try:
        size = fp.seek(0, os.SEEK_END)
        start = max(0, size - OUTPUT_TAIL)
        fp.seek(start)
        data = fp.read()
        before = _line_before(fp, start)
    except OSError:
        return ""
    lines = split_clean(data, OUTPUT_LINE_LIMIT, colours=False, dropped=before)
    return b"\n".join(lines).decode(errors="replace")


def _line_before(fp: IO[bytes], end: int, most: int = 1 << 24) -> int:
    """Bytes before ``end`` of the line that goes on at ``end`` (up to ``most``)."""
    pos = end
    while pos > 0 and end - pos < most:
        block = min(OUTPUT_TAIL, pos)
        fp.seek(pos - block)
        newline = fp.read(block).rfind(b"\n")
        if newline >= 0:
            return end - (pos - block + newline + 1)
        pos -= block
    return end - pos
