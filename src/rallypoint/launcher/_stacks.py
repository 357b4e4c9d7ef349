"""Python stacks of running workers, on demand, grouped by identical stacks.

Worker side: :func:`install_stack_dumper` (called by the worker bootstrap before user
code) registers :func:`faulthandler.register` for a signal, writing every thread's stack
into ``$RALLYPOINT_STACKS_DIR/<pid>.stacks``. faulthandler writes from the C signal
handler, so a worker blocked inside a gloo/NCCL call or holding the GIL in C code still
answers. The file appears (renamed into place) only once the handler is installed, so the
agent never sends the signal, whose default action kills, to a worker without it.

Agent side: :func:`collect_stacks` signals the local workers and parses their dumps into
:class:`StackDump` objects (JSON-serialisable, for gathering across nodes through the
store); :func:`format_grouped_stacks` groups ranks whose main-thread stacks are identical::

    ranks 0,2,3: all_reduce at train.py:42
    rank 1: sleep at train.py:17

each followed once by the full stack with source lines.

The signal: ``SIGRTMIN+4`` by default (``RALLYPOINT_STACKS_SIGNAL`` overrides it, as a
number or a name like ``SIGUSR1``). SIGUSR1/SIGUSR2 are taken: SLURM's ``--signal`` and
Lightning use them for pre-emption, and c10d's fatal-signal handler uses SIGUSR2.

Across nodes (``rallypoint stacks --rdzv-endpoint ... --rdzv-id ...``, or the agent that
detected a hang) the exchange goes through any store with torch's ``set/get/add/check``
(pass a ``PrefixStore`` for the run): :func:`request_stacks` bumps a request counter and
waits; every agent polls :func:`answer_stacks_request` from its monitor loop (one ``add``
per tick when idle), collects its workers' stacks and publishes them as JSON.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import re
import signal
import socket
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any, Protocol

__all__ = [
    "DEFAULT_STACKS_SIGNAL",
    "STACKS_DIR_ENV",
    "STACKS_SIGNAL_ENV",
    "Frame",
    "StackDump",
    "StacksStore",
    "ThreadStack",
    "answer_stacks_request",
    "collect_stacks",
    "format_grouped_stacks",
    "install_stack_dumper",
    "latest_stacks_request",
    "parse_faulthandler_dump",
    "publish_node_count",
    "remove_dump_file",
    "request_stacks",
    "stack_summary",
    "stacks_env",
]

STACKS_DIR_ENV = "RALLYPOINT_STACKS_DIR"
STACKS_SIGNAL_ENV = "RALLYPOINT_STACKS_SIGNAL"
DEFAULT_STACKS_SIGNAL = int(signal.SIGRTMIN) + 4

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
    runs the training loop in a worker.
    """

    rank: int
    host: str
    pid: int | None
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None

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
            return cls(
                rank=int(obj["rank"]),
                host=str(obj["host"]),
                pid=None if pid is None else int(pid),
                threads=threads,
                error=None if error is None else str(error),
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
    limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if limit <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    signum = _signal_number(signum)
    host = host if host is not None else socket.gethostname()
    directory = os.fspath(directory)
    results: dict[int, StackDump] = {}
    waiting: dict[int, tuple[int, str]] = {}  # rank -> (pid, path)
    for rank, pid in sorted(pids_by_rank.items()):
        path = os.path.join(directory, f"{pid}.stacks")
        if not os.path.exists(path):
            results[rank] = StackDump(
                rank=rank,
                host=host,
                pid=pid,
                error="no stack dump handler (not a rallypoint worker, or still starting)",
            )
            continue
        try:
            os.truncate(path, 0)
            os.kill(pid, signum)
        except ProcessLookupError:
            results[rank] = StackDump(rank=rank, host=host, pid=pid, error="process has exited")
            continue
        except OSError as exc:
            results[rank] = StackDump(
                rank=rank, host=host, pid=pid, error=f"cannot signal it: {exc.strerror}"
            )
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
                alive = _alive(pid)
                reason = f"no dump within {limit:g} s" if alive else "process has exited"
                results[rank] = StackDump(rank=rank, host=host, pid=pid, error=reason)
            break
        time.sleep(0.01)
    return dict(sorted(results.items()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------- summarising


@functools.cache
def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rallypoint
    roots.update(p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p)
    return tuple(sorted(os.path.join(r, "") for r in roots))


_WRAPPER_NAMES = frozenset(
    {"wrapper", "inner", "wrapped", "_fn", "decorate_context", "<lambda>", "<genexpr>", "__call__"}
)


def _is_library(filename: str) -> bool:
    return filename.startswith("<") or filename.startswith(_library_prefixes())


def _called_in(source: str) -> str | None:
    """The outermost call's name in a line of source (``dist.all_reduce(t)`` → ``all_reduce``)."""
    try:
        tree = ast.parse(source.rstrip(":").strip() or "pass")
    except SyntaxError:
        m = re.search(r"([A-Za-z_]\w*)\s*\(", source)
        return m.group(1) if m else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                return func.attr
            if isinstance(func, ast.Name):
                return func.id
    return None


def stack_summary(frames: tuple[Frame, ...]) -> str:
    """One line for a stack (innermost first): what the innermost user frame is waiting in.

    ``all_reduce at train.py:42`` when user code called into a library; for a frame blocked
    in C (``time.sleep``), the call named on its source line; ``in f at x.py:3`` otherwise.
    """
    if not frames:
        return "no Python frames"
    user = next((i for i, f in enumerate(frames) if not _is_library(f.filename)), None)
    if user is None:
        f = frames[0]
        return f"{f.name} at {os.path.basename(f.filename)}:{f.lineno}"
    at = f"{os.path.basename(frames[user].filename)}:{frames[user].lineno}"
    for callee in reversed(frames[:user]):  # from the frame user code called, inwards
        if callee.name not in _WRAPPER_NAMES and not re.match(r"_[^_]", callee.name):
            return f"{callee.name} at {at}"
    if user > 0:
        return f"{frames[user - 1].name} at {at}"
    called = _called_in(frames[user].source) if frames[user].source else None
    if called is not None:
        return f"{called} at {at}"
    return f"in {frames[user].name} at {at}"


def _ranks_text(ranks: list[int]) -> str:
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(parts)


def _format_frames(frames: tuple[Frame, ...], indent: str) -> list[str]:
    out = []
    for f in reversed(frames):  # traceback order: most recent call last
        out.append(f'{indent}File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.source:
            out.append(f"{indent}  {f.source}")
    return out


def format_grouped_stacks(stacks_by_rank: Mapping[int, StackDump]) -> str:
    """Group ranks (global, across nodes) whose main-thread stacks are identical.

    One headline per group (``ranks 0,2,3: all_reduce at train.py:42``), the hosts and
    pids, then the group's full main-thread stack once (most recent call last) and the
    innermost frame of each other thread. Workers without a dump are grouped by reason.
    """
    groups: dict[tuple[Any, ...], list[StackDump]] = {}
    for rank in sorted(stacks_by_rank):
        dump = stacks_by_rank[rank]
        main = dump.main
        if dump.error is not None or main is None:
            key: tuple[Any, ...] = ("error", dump.error or "empty dump")
        else:
            key = ("stack", tuple((f.filename, f.lineno, f.name) for f in main.frames))
        groups.setdefault(key, []).append(dump)
    lines: list[str] = []
    for key, dumps in groups.items():
        ranks = [d.rank for d in dumps]
        first = dumps[0]
        main = first.main
        if key[0] == "error" or main is None:
            lines.append(f"{_ranks_text(ranks)}: no stack: {key[1]}")
        else:
            lines.append(f"{_ranks_text(ranks)}: {stack_summary(main.frames)}")
        by_host: dict[str, list[str]] = {}
        for d in dumps:
            by_host.setdefault(d.host, []).append(
                f"{d.rank}" + (f" (pid {d.pid})" if d.pid else "")
            )
        lines.append("  on " + "; ".join(f"{h}: {', '.join(rs)}" for h, rs in by_host.items()))
        if key[0] == "stack" and main is not None:
            lines.append("  Stack (most recent call last):")
            lines.extend(_format_frames(main.frames, "    "))
            others = [t for t in first.threads if t is not main]
            for t in others:
                where = stack_summary(t.frames) if t.frames else "no Python frames"
                lines.append(f"  other thread {t.thread_id}: {where}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n" if lines else ""


def remove_dump_file(directory: str | os.PathLike[str], pid: int) -> None:
    """Delete an exited worker's dump file (the agent calls this when it reaps a worker)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(os.fspath(directory), f"{pid}.stacks"))


# ---------------------------------------------------------------------------- across nodes


class StacksStore(Protocol):
    """The part of torch's ``c10d.Store`` the exchange uses (TCPStore, FileStore, ...)."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, amount: int, /) -> int: ...
    def check(self, keys: list[str], /) -> bool: ...


_REQUEST = "stacks/request"
_NNODES = "stacks/nnodes"


def publish_node_count(store: StacksStore, nnodes: int) -> None:
    """Agents call this after each round so that a requester knows how many answers to expect."""
    store.set(_NNODES, str(nnodes))


def latest_stacks_request(store: StacksStore) -> int:
    """The newest request id; an agent starts answering after this one."""
    return store.add(_REQUEST, 0)


def answer_stacks_request(
    store: StacksStore,
    *,
    node_rank: int,
    answered: int,
    collect: Callable[[], Mapping[int, StackDump]],
) -> int:
    """Answer requests newer than ``answered`` (collecting once); return the newest answered.

    Cheap when there is nothing to do: one ``add(key, 0)`` round trip.
    """
    latest = store.add(_REQUEST, 0)
    if latest <= answered:
        return answered
    payload = json.dumps([d.to_json() for d in collect().values()])
    for n in range(max(answered + 1, latest - 8), latest + 1):  # skip requests long gone
        store.set(f"stacks/{n}/node/{node_rank}", payload)
        store.add(f"stacks/{n}/count", 1)
    return latest


def request_stacks(
    store: StacksStore,
    *,
    timeout: timedelta | float,
    nnodes: int | None = None,
) -> tuple[dict[int, StackDump], dict[int, str]]:
    """Ask every agent for its workers' stacks and wait for ``nnodes`` answers or ``timeout``.

    Returns the dumps by global rank, and ``{node_rank: why}`` for nodes that did not answer
    or answered garbage. ``nnodes=None`` uses the count the agents published; ``ValueError``
    if there is none (no agent of this run is running).
    """
    limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if limit <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if nnodes is None:
        if not store.check([_NNODES]):
            raise ValueError("no agent of this run has published its node count: is it running?")
        raw = store.get(_NNODES).decode(errors="replace")
        if not raw.isdigit():
            raise ValueError(f"the store holds a bad node count {raw!r} under {_NNODES!r}")
        nnodes = int(raw)
    n = store.add(_REQUEST, 1)
    deadline = time.monotonic() + limit
    while store.add(f"stacks/{n}/count", 0) < nnodes and time.monotonic() < deadline:
        time.sleep(0.02)
    dumps: dict[int, StackDump] = {}
    missing: dict[int, str] = {}
    for node in range(nnodes):
        key = f"stacks/{n}/node/{node}"
        if not store.check([key]):
            missing[node] = f"no answer within {limit:g} s"
            continue
        try:
            records = json.loads(store.get(key))
            if not isinstance(records, list):
                raise ValueError(f"expected a list, got {type(records).__name__}")
            for record in records:
                dump = StackDump.from_json(record)
                dumps[dump.rank] = dump
        except ValueError as exc:
            missing[node] = f"unreadable answer: {exc}"
    return dict(sorted(dumps.items())), missing
