"""Python stacks of running workers, on demand: the worker's dump handler and collecting.

Worker side: :func:`install_stack_dumper` registers :func:`faulthandler.register` for a
signal (``SIGRTMIN+4`` by default, ``RALLYPOINT_STACKS_SIGNAL`` overrides it; SIGUSR1/2
are taken by SLURM, Lightning and c10d). faulthandler writes from the C signal handler, so
a worker blocked in a gloo/NCCL call still answers. Agent side: :func:`collect_stacks`
first asks each worker's Flight Recorder thread to dump from Python with the GIL held
(:func:`dump_stacks_now`), and signals only a worker whose thread does not answer within
:data:`THREAD_WAIT`. The dumps are parsed into :class:`StackDump` objects
(JSON-serialisable, for ``_stacks_exchange``); ``_stacks_format`` groups them for people.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

from rallypoint._core import envvars
from rallypoint._core.checks import check_seconds
from rallypoint._core.procs import pid_alive
from rallypoint._watch._fifo import STACKS_REQUEST, ask
from rallypoint._watch._flight._records import RankTrace

__all__ = [
    "DEFAULT_STACKS_SIGNAL",
    "STACKS_DIR_ENV",
    "STACKS_SIGNAL_ENV",
    "Frame",
    "StackDump",
    "ThreadStack",
    "collect_stacks",
    "install_stack_dumper",
    "parse_faulthandler_dump",
    "positive_seconds",
    "remove_dump_file",
    "stacks_env",
]

STACKS_DIR_ENV = envvars.STACKS_DIR
STACKS_SIGNAL_ENV = envvars.STACKS_SIGNAL
DEFAULT_STACKS_SIGNAL = int(signal.SIGRTMIN) + 4
THREAD_WAIT = 1.0
"""Seconds a worker's Flight Recorder thread has to write its stacks before the signal."""

_dump_file: IO[str] | None = None  # kept open for faulthandler for the process' lifetime


def _signal_number(value: str | int) -> int:
    if isinstance(value, int):
        number = value
    else:
        text = value.strip()
        if text.isdigit():
            number = int(text)
        else:
            sig = getattr(signal, text.upper(), None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(
                    f"{STACKS_SIGNAL_ENV}={value!r} is not a signal: give a number or a name "
                    "like SIGUSR1"
                )
            number = int(sig)
    if number in (signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGINT, signal.SIGTERM):
        raise ValueError(f"signal {number} cannot be used for stack dumps; pick another")
    if not 1 <= number < signal.NSIG:
        raise ValueError(f"signal number {number} is out of range [1, {signal.NSIG})")
    return number


def positive_seconds(timeout: timedelta | float) -> float:
    """A wait in seconds from a ``timedelta`` or a number; ``ValueError`` unless positive."""
    try:
        seconds = check_seconds(timeout, "timeout", numbers=True)
    except ValueError:
        raise ValueError(f"timeout must be positive, got {timeout!r}") from None
    assert seconds is not None
    return seconds


def stacks_env(
    directory: str | os.PathLike[str], signum: int = DEFAULT_STACKS_SIGNAL
) -> dict[str, str]:
    """The variables the agent puts in each worker's environment."""
    return {STACKS_DIR_ENV: os.fspath(directory), STACKS_SIGNAL_ENV: str(_signal_number(signum))}


def install_stack_dumper(env: Mapping[str, str] | None = None) -> str | None:
    """Install the stack dump handler in this (worker) process; return its dump file.

    Returns ``None`` (and does nothing) when ``RALLYPOINT_STACKS_DIR`` is not set.
    """
    global _dump_file
    import faulthandler

    env = os.environ if env is None else env
    directory = env.get(STACKS_DIR_ENV)
    if not directory:
        return None
    signum = _signal_number(env.get(STACKS_SIGNAL_ENV, str(DEFAULT_STACKS_SIGNAL)))
    pid = os.getpid()
    tmp = os.path.join(directory, f"{pid}.tmp")
    final = os.path.join(directory, f"{pid}.stacks")
    fh = open(tmp, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(signum, file=fh, all_threads=True, chain=False)
    if _dump_file is not None:
        _dump_file.close()  # a forked child re-installing: drop the parent's file object
    _dump_file = fh
    os.replace(tmp, final)  # visible only now that the handler is in place
    return final


def dump_stacks_now() -> None:
    """Write every thread's stack into this worker's dump file, as the signal would, but
    from Python with the GIL held: no other thread's frames change meanwhile, where
    faulthandler's signal handler reads them racing the threads that run (a worker whose
    other thread was importing has died of it). The Flight Recorder thread calls this on
    the agent's request (``_flight._recorder.install_flight_dumper``)."""
    import faulthandler

    if _dump_file is not None:
        faulthandler.dump_traceback(file=_dump_file, all_threads=True)


# ---------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python frame; ``source`` is the stripped source line where it could be read."""

    filename: str
    lineno: int
    name: str
    source: str = ""


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread of a dump; ``frames`` are innermost first, as faulthandler prints them."""

    thread_id: str
    current: bool
    frames: tuple[Frame, ...]


_HEADER = re.compile(
    r"^(?:(?P<cur>Current thread)|Thread) (?P<id>0x[0-9a-fA-F]+)[^(]*\(most recent call first\):"
    r"|^Stack \(most recent call first\):"
)
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.*)$')


def parse_faulthandler_dump(text: str) -> list[ThreadStack]:
    """Parse :mod:`faulthandler` output into threads (in the order printed).

    Raises ``ValueError`` when ``text`` holds no thread header at all.
    """
    threads: list[ThreadStack] = []
    header: tuple[str, bool] | None = None
    frames: list[Frame] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m is not None:
            if header is not None:
                threads.append(ThreadStack(header[0], header[1], tuple(frames)))
            header = (m.group("id") or "", m.group("cur") is not None)
            frames = []
            continue
        f = _FRAME.match(line)
        if f is not None and header is not None:
            lineno = int(f.group("line")) if f.group("line").isdigit() else 0
            frames.append(Frame(f.group("file"), lineno, f.group("name")))
    if header is None:
        raise ValueError("not a faulthandler dump: no 'Thread ... (most recent call first):' line")
    threads.append(ThreadStack(header[0], header[1], tuple(frames)))
    return threads


@dataclass(frozen=True, slots=True)
class StackDump:
    """The stacks of one worker (``threads``), or why there are none (``error``).

    ``main`` is the process' oldest thread (faulthandler lists it last): the one that
    runs the training loop in a worker. ``flight`` is its Flight Recorder, when asked for.
    """

    rank: int
    host: str
    pid: int | None
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None
    flight: RankTrace | None = None

    @property
    def main(self) -> ThreadStack | None:
        return self.threads[-1] if self.threads else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-compatible dict (for the store); :meth:`from_json` reverses it."""
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "error": self.error,
            "threads": [
                {
                    "id": t.thread_id,
                    "current": t.current,
                    "frames": [[f.filename, f.lineno, f.name, f.source] for f in t.frames],
                }
                for t in self.threads
            ],
            "flight": None if self.flight is None else self.flight.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Any) -> StackDump:
        """Rebuild a dump from :meth:`to_json`'s output; ``ValueError`` if malformed."""
        try:
            threads = tuple(
                ThreadStack(
                    str(t["id"]),
                    bool(t["current"]),
                    tuple(
                        Frame(str(f), int(n), str(name), str(src))
                        for f, n, name, src in t["frames"]
                    ),
                )
                for t in obj["threads"]
            )
            pid = obj["pid"]
            error = obj["error"]
            flight = obj.get("flight")
            return cls(
                rank=int(obj["rank"]),
                host=str(obj["host"]),
                pid=None if pid is None else int(pid),
                threads=threads,
                error=None if error is None else str(error),
                flight=None if flight is None else RankTrace.from_json(flight),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed stack dump record: {exc!r}") from None


# ---------------------------------------------------------------------------- collecting


def _with_sources(
    threads: list[ThreadStack], cache: dict[str, list[str] | None]
) -> tuple[ThreadStack, ...]:
    def line_of(filename: str, lineno: int) -> str:
        if filename not in cache:
            try:
                with open(filename, encoding="utf-8", errors="replace") as fh:
                    cache[filename] = fh.read().splitlines()
            except OSError:
                cache[filename] = None
        lines = cache[filename]
        return lines[lineno - 1].strip() if lines and 0 < lineno <= len(lines) else ""

    return tuple(
        ThreadStack(
            t.thread_id,
            t.current,
            tuple(
                Frame(f.filename, f.lineno, f.name, line_of(f.filename, f.lineno)) for f in t.frames
            ),
        )
        for t in threads
    )


def collect_stacks(
    pids_by_rank: Mapping[int, int],
    timeout: timedelta | float,
    *,
    directory: str | os.PathLike[str],
    signum: int = DEFAULT_STACKS_SIGNAL,
    host: str | None = None,
    settle: float = 0.05,
) -> dict[int, StackDump]:
    """Signal each worker and return its parsed stacks, keyed like ``pids_by_rank``.

    ``directory`` and ``signum`` are what the agent passed to :func:`stacks_env`. A worker
    without a handler, already gone, or silent for ``timeout`` gets a dump with ``error``
    set; this never raises for a worker's state. A dump is complete once its file stopped
    growing for ``settle`` seconds.
    """
    limit = positive_seconds(timeout)
    signum = _signal_number(signum)
    host = host if host is not None else socket.gethostname()
    directory = os.fspath(directory)
    results: dict[int, StackDump] = {}
    waiting: dict[int, tuple[int, str]] = {}  # rank -> (pid, path)
    signal_at: dict[int, float] = {}  # asked its thread: signal it if no dump by then
    for rank, pid in sorted(pids_by_rank.items()):
        path = os.path.join(directory, f"{pid}.stacks")
        why = _emptied(path)
        if why is None:
            if ask(directory, pid, STACKS_REQUEST) is None:  # its thread dumps, GIL held
                signal_at[rank] = time.monotonic() + THREAD_WAIT
            else:  # no thread to ask: the signal, now
                why = _signal(pid, signum)
        if why is not None:
            results[rank] = StackDump(rank=rank, host=host, pid=pid, error=why)
            continue
        waiting[rank] = (pid, path)

    deadline = time.monotonic() + limit
    sizes: dict[int, tuple[int, float]] = {}  # rank -> (size, when it last changed)
    cache: dict[str, list[str] | None] = {}
    while waiting:
        now = time.monotonic()
        for rank, (pid, path) in list(waiting.items()):
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = 0
            if size == 0 and now >= signal_at.get(rank, now + 1):
                del signal_at[rank]
                why = _signal(pid, signum)  # its thread did not answer (the GIL is held)
                if why is not None:
                    results[rank] = StackDump(rank=rank, host=host, pid=pid, error=why)
                    del waiting[rank]
                    continue
            old = sizes.get(rank)
            if old is None or old[0] != size:
                sizes[rank] = (size, now)
            elif size > 0 and now - old[1] >= settle:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                try:
                    threads = _with_sources(parse_faulthandler_dump(text), cache)
                    results[rank] = StackDump(rank=rank, host=host, pid=pid, threads=threads)
                except ValueError as exc:
                    results[rank] = StackDump(rank=rank, host=host, pid=pid, error=str(exc))
                del waiting[rank]
        if not waiting:
            break
        if now >= deadline:
            for rank, (pid, _) in waiting.items():
                alive = pid_alive(pid)
                reason = f"no dump within {limit:g} s" if alive else "process has exited"
                results[rank] = StackDump(rank=rank, host=host, pid=pid, error=reason)
            break
        time.sleep(0.01)
    return dict(sorted(results.items()))


def _emptied(path: str) -> str | None:
    """Empty a worker's dump file for the next dump; why that cannot be done, if so."""
    if not os.path.exists(path):
        return "no stack dump handler (not a rallypoint worker, or still starting)"
    try:
        os.truncate(path, 0)
    except OSError as exc:
        return f"cannot empty its dump file: {exc.strerror}"
    return None


def _signal(pid: int, signum: int) -> str | None:
    """Send the stack-dump signal; why it could not be sent, if so."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return "process has exited"
    except OSError as exc:
        return f"cannot signal it: {exc.strerror}"
    return None


def remove_dump_file(directory: str | os.PathLike[str], pid: int) -> None:
    """Delete an exited worker's dump file (the agent calls this when it reaps a worker)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(os.fspath(directory), f"{pid}.stacks"))
