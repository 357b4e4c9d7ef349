"""Running one health check: a command in a session of its own, bounded in time, and
how a check ended (:class:`CheckResult`); what the built-in checks look at on this node
(:class:`HealthContext`). The checks themselves: ``_builtin_checks``; the list a node runs
and the screen of a failure: ``_health``."""

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

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["CheckResult", "HealthContext", "run_command"]

POLL_EVERY = 0.05


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
    everything it started after ``timeout`` seconds; ``poll()`` may raise to stop it."""
    started = time.monotonic()
    with _output_file() as out:
        proc = subprocess.Popen(
            argv or ["/bin/sh", "-c", command],
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
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
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


def _read(fp: IO[bytes] | None, limit: int = 64 * 1024) -> str:
    if fp is None:
        return ""
    try:
        size = fp.seek(0, os.SEEK_END)
        fp.seek(max(0, size - limit))
        return fp.read().decode(errors="replace")
    except OSError:
        return ""
