"""Run a function in N forked worker processes: the multi-process test harness.

Workers are forked from a process that has already imported torch, so a test with four
gloo ranks does not pay four ``import torch``: the zygote inside :func:`worker_zygote`
(:mod:`rallypoint.testing._zygote`), else the caller itself. Each child gets the
environment a launcher would give it and a fresh ``MASTER_PORT`` per call, kept from other
processes until the workers end (``reserved_port``). This is a test helper, not the
launcher: no restarts, no output handling, no rendezvous, and every call has a deadline.
Workers still running at the deadline dump their stacks before they are killed, and the
``TimeoutError`` says where each hung (:func:`run_workers`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from rallypoint._core.blocking import settle_before_fork
from rallypoint._core.checks import check_int
from rallypoint._core.net import reserved_port
from rallypoint.testing._native_stacks import native_stacks, short_native
from rallypoint.testing._zygote import Zygote

DUMP_SIGNAL = int(signal.SIGRTMIN) + 5
"""The signal on which a worker writes every thread's stack to its dump file (faulthandler).
Not ``SIGRTMIN+4``, which rallypoint's hang detection uses, nor SIGUSR1/2."""
_DUMP_WAIT = 0.5  # seconds the workers get to write their stacks
_SHORT_FRAMES = 4  # innermost frames per thread in a TimeoutError's message
_SETTLE_WAIT = 10.0
"""Most seconds to wait before forking for store calls that an earlier test abandoned in
a thread of this process and that end soon (see ``settle_before_fork``): one still in
torch's connect at the fork left a worker's own connect blocked for good."""


_ZYGOTE: Zygote | None = None
"""The zygote that forks this process's workers, while :func:`worker_zygote` holds one."""


def _no_zygote_in_a_child() -> None:
    global _ZYGOTE
    _ZYGOTE = None  # the caller's: a child forks its own workers


os.register_at_fork(after_in_child=_no_zygote_in_a_child)


@contextlib.contextmanager
def worker_zygote() -> Iterator[Zygote]:
    """Fork every :func:`run_workers` worker from a zygote for the duration of the block.

    Enter it while this process has no other threads (in a pytest session fixture, before
    any test ran): the zygote is a copy of this process as it is now, single-threaded from
    then on, so a worker never inherits a lock held by another thread of the caller (see
    :mod:`rallypoint.testing._zygote`). Workers' functions must then be importable by name
    (module level) and their arguments must pickle. Not reentrant."""
    global _ZYGOTE
    if _ZYGOTE is not None:
        raise RuntimeError("worker_zygote() is already active in this process")
    zygote = Zygote()
    _ZYGOTE = zygote
    try:
        yield zygote
    finally:
        _ZYGOTE = None
        zygote.close()


class WorkerError(RuntimeError):
    """A worker raised, or died without reporting a result."""

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        remote_traceback: str = "",
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(
            f"rank {rank}: {message}" + (f"\n{remote_traceback}" if remote_traceback else "")
        )
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        self.exception = exception
        # ranks whose processes had died by a signal when this failure was reported
        # (filled in by run_workers, before it kills the survivors)
        self.signalled: list[int] = []


def _apply_thread_count(env: Mapping[str, str]) -> None:
    """Give torch the worker's ``OMP_NUM_THREADS`` now, as the launcher's workers do.

    torch in a forked child keeps the parent's intra-op thread count; the variable alone
    changes nothing. With the parent's count, a child of a process that already ran a
    parallel op would hang in its own first one (GNU OpenMP is not fork-safe); with one
    thread no OpenMP team is used.
    """
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _child_main(
    rank: int,
    conn: Connection,
    dump_fd: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    faulthandler.register(DUMP_SIGNAL, file=dump_fd, all_threads=True, chain=False)
    _apply_thread_count(env)
    try:
        result: Any = fn(*args)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # SystemExit too: reported to the parent
        tb = traceback.format_exc()
        try:
            pickled_exc: bytes | None = pickle.dumps(exc)
        except Exception:
            pickled_exc = None
        payload = pickle.dumps(("err", f"{type(exc).__name__}: {exc}", tb, pickled_exc))
    conn.send_bytes(payload)
    conn.close()


def _zygote_child_main(
    fds: list[int],
    rank: int,
    env: dict[str, str],
    cwd: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """A worker forked by the zygote: the caller's environment and directory as they are
    now (not as they were when the zygote was made), then :func:`_child_main`."""
    report_fd, dump_fd = fds
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _child_main(rank, Connection(report_fd, readable=False), dump_fd, env, fn, args)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` forked processes and return their results by rank.

    ``env`` adds variables to every worker (a mapping) or per rank (a callable taking the
    rank). With ``return_exceptions=False`` the first failure kills the other workers and
    raises :class:`WorkerError`; with ``True`` every worker runs to its end and failures are
    returned in place of results (the original exception when it pickles, else a
    ``WorkerError``). Workers still running at ``timeout`` seconds are killed and
    ``TimeoutError`` names them.

    Forked from the caller (outside :func:`worker_zygote`), it first waits a bounded time
    for the caller's threads that end soon (a child forked while one runs in torch's C++
    connect can inherit its locks held). Workers still running at the deadline write every
    thread's Python stack (faulthandler, on ``SIGRTMIN+5``) before they are killed; the
    stacks go to stderr and, in short, into the ``TimeoutError``, so a CI log that keeps
    only the failure's message still says where every worker hung; where gdb can attach,
    so do their native stacks.
    """
    check_int(world_size, "world_size", minimum=1)
    if _ZYGOTE is None:
        settle_before_fork(_SETTLE_WAIT)
    procs: list[Any] = []  # multiprocessing's fork-context Process type is not exported
    conns: dict[Connection, int] = {}
    with contextlib.ExitStack() as files:
        # held until the workers are gone: a port merely free when picked was taken by
        # another process before rank 0's store bound it (a suite beside this one), and
        # the other ranks waited out their store connect timeout
        port = files.enter_context(reserved_port())
        dumps = [files.enter_context(tempfile.TemporaryFile()) for _ in range(world_size)]
        try:
            for rank in range(world_size):
                child_env = _child_env(rank, world_size, port, env)
                conns[_start(rank, child_env, fn, args, dumps[rank].fileno(), procs)] = rank
            return _collect(procs, conns, timeout, return_exceptions, dumps)
        except WorkerError as exc:
            exc.signalled = _signalled(procs)
            raise
        finally:
            _stop(procs, conns)


def runner_for(backend: str) -> Callable[..., list[Any]]:
    """How to run workers on ``backend``: :func:`run_reference_workers` for torch's
    ``TENSORPIPE`` (the reference), :func:`run_workers` for everything else."""
    return run_reference_workers if backend == "TENSORPIPE" else run_workers


_REFERENCE_RETRIES = 2


def run_reference_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """:func:`run_workers` for a *reference* run on torch's own stack (TensorPipe), which
    is repeated up to twice if a worker died by a signal.

    torch's TensorPipe agent now and then aborts a worker (SIGABRT, ``std::bad_alloc``;
    seen in full test-suite runs here, in ``init_rpc``'s start-up all-gather and in the
    middle of a program, once twice in a row). The failure reported first may then be
    another rank's ``eof`` from the dead peer; either way it is a failure of the
    reference the test compares against, not of the code under test: the code under test
    always runs with :func:`run_workers`, without a second chance.

    Likewise when a worker fails with torch's ``DistNetworkError``: on a busy host torch's
    ``shutdown()`` sometimes finds the store host gone before its own barrier is done
    ("Connection reset by peer" in ``agent.join``).
    """
    from torch.distributed import DistNetworkError

    for _ in range(_REFERENCE_RETRIES):
        try:
            return run_workers(fn, world_size, *args, timeout=timeout, env=env)
        except WorkerError as exc:
            torch_network = isinstance(exc.exception, DistNetworkError)
            if not exc.signalled and not torch_network:
                raise
            lost = f"lost ranks {exc.signalled} to a signal" if exc.signalled else "failed"
            print(
                f"reference run {lost} ({exc.message}); running it again",
                file=sys.stderr,
            )
    return run_workers(fn, world_size, *args, timeout=timeout, env=env)


def _child_env(
    rank: int,
    world_size: int,
    port: int,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None,
) -> dict[str, str]:
    """What a launcher would set for ``rank``, plus the caller's ``env``."""
    child_env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    extra = env(rank) if callable(env) else env
    if extra:
        child_env.update(extra)
    return child_env


def _start(
    rank: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    dump_fd: int,
    procs: list[Any],
) -> Connection:
    """Fork the worker of ``rank`` (appended to ``procs``); return the end it reports on."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    if _ZYGOTE is not None:
        full_env = {**os.environ, **env}
        try:
            procs.append(
                _ZYGOTE.fork(
                    _zygote_child_main,
                    (rank, full_env, os.getcwd(), fn, args),
                    [1, 2, writer.fileno(), dump_fd],
                )
            )
        except BaseException:  # Ctrl-C too: the pipe is closed
            reader.close()
            raise
        finally:
            writer.close()
        return reader
    proc = ctx.Process(target=_child_main, args=(rank, writer, dump_fd, env, fn, args), daemon=True)
    proc.start()
    writer.close()
    procs.append(proc)
    return reader


def _collect(
    procs: list[Any],
    conns: dict[Connection, int],
    timeout: float,
    return_exceptions: bool,
    dumps: list[Any],
) -> list[Any]:
    """Each worker's result by rank, as their reports arrive, within ``timeout`` seconds."""
    results: list[Any] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(pending.values())
            stacks = _dump_stacks({rank: (procs[rank], dumps[rank]) for rank in ranks})
            native = native_stacks([procs[rank].pid for rank in ranks])
            lines = []
            for rank, text in stacks.items():
                lines.append(f"rank {rank}: {_short(text)}")
                if (backtrace := native.get(procs[rank].pid)) is not None:
                    sys.stderr.write(f"--- rank {rank}'s native threads (gdb)\n{backtrace}")
                    lines.append(f"rank {rank} native: {short_native(backtrace)}")
            raise TimeoutError(
                f"workers {ranks} still running after {timeout:.1f} s; their threads, "
                "innermost frame first (full stacks on stderr):\n" + "\n".join(lines)
            )
        for conn in wait(list(pending), timeout=remaining):
            assert isinstance(conn, Connection)
            rank = pending.pop(conn)
            ok, value = _report(rank, conn, procs[rank])
            if ok:
                results[rank] = value
            elif return_exceptions:  # the worker's own exception when it pickled
                results[rank] = value.exception or value
            else:
                raise value
    return results


def _dump_stacks(workers: dict[int, tuple[Any, Any]]) -> dict[int, str]:
    """Have the workers (rank: (process, dump file)) write their threads' stacks; print
    each to stderr and return them by rank."""
    for proc, _ in workers.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, DUMP_SIGNAL)
    time.sleep(_DUMP_WAIT)
    stacks: dict[int, str] = {}
    for rank, (_, dump) in workers.items():
        dump.seek(0)
        stacks[rank] = dump.read().decode(errors="replace")
        sys.stderr.write(f"--- rank {rank}'s threads\n{stacks[rank]}")
    sys.stderr.flush()
    return stacks


_FRAME = re.compile(r'^\s+File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<fn>\S+)$')


def _short(dump: str) -> str:
    """A faulthandler dump in short: each thread's innermost frames on one line."""
    threads: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Current thread "):
            threads.append([])  # the thread that took the signal: the main one
        elif line.startswith("Thread "):
            threads.append([])
        elif (frame := _FRAME.match(line)) and threads and len(threads[-1]) < _SHORT_FRAMES:
            name = os.path.basename(frame["path"])
            threads[-1].append(f"{frame['fn']} ({name}:{frame['line']})")
    if not threads:
        return "no stacks (the worker did not answer the signal)"
    return " | ".join(" < ".join(frames) or "?" for frames in threads)


def _report(rank: int, conn: Connection, proc: Any) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, WorkerError)`` for a worker that failed."""
    try:
        message = pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.join(5)
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"died by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code} without a result"
        return False, WorkerError(rank, how)
    if message[0] == "ok":
        return True, message[1]
    _, text, tb, pickled_exc = message
    original: BaseException | None = None
    if pickled_exc is not None:
        try:
            original = pickle.loads(pickled_exc)
        except Exception:
            original = None
    return False, WorkerError(rank, text, remote_traceback=tb, exception=original)


def _signalled(procs: list[Any]) -> list[int]:
    """Ranks whose processes have exited by a signal (none is waited for)."""
    return [
        rank
        for rank, proc in enumerate(procs)
        if not proc.is_alive() and proc.exitcode is not None and proc.exitcode < 0
    ]


def _stop(procs: list[Any], conns: dict[Connection, int]) -> None:
    """Kill the workers still running, reap them and close the pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)
    for conn in conns:
        conn.close()
