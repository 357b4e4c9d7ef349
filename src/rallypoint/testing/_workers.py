"""Run a function in N forked worker processes: the multi-process test harness.

The calling process (a pytest worker that has already imported torch) is the warm
process: children are forked from it, so a test with four gloo ranks does not pay four
``import torch``. Each child gets the environment a launcher would give it (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...) and a fresh free ``MASTER_PORT`` per call.

This is a test helper, not the product launcher (``rallypoint.launch``): it has no
restarts, no output handling and no rendezvous; it exists so that every part's tests can
run real processes cheaply and never hang (every call has a deadline).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from rallypoint._core.net import free_port


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


def _child_main(
    rank: int,
    conn: Connection,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        result: Any = fn(*args)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:
        tb = traceback.format_exc()
        try:
            pickled_exc: bytes | None = pickle.dumps(exc)
        except Exception:
            pickled_exc = None
        payload = pickle.dumps(("err", f"{type(exc).__name__}: {exc}", tb, pickled_exc))
    conn.send_bytes(payload)
    conn.close()


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
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs: list[Any] = []  # multiprocessing's fork-context Process type is not exported
    conns: dict[Connection, int] = {}
    for rank in range(world_size):
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
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child_main, args=(rank, writer, child_env, fn, args), daemon=True
        )
        proc.start()
        writer.close()
        procs.append(proc)
        conns[reader] = rank

    results: list[Any] = [None] * world_size
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending.values())
                raise TimeoutError(f"workers {ranks} still running after {timeout:.1f} s")
            for conn in wait(list(pending), timeout=remaining):
                assert isinstance(conn, Connection)
                rank = pending.pop(conn)
                try:
                    message = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    code = procs[rank].exitcode
                    if code is not None and code < 0:
                        how = f"died by signal {signal.Signals(-code).name}"
                    else:
                        how = f"exited with code {code} without a result"
                    failure = WorkerError(rank, how)
                    if not return_exceptions:
                        raise failure from None
                    results[rank] = failure
                    continue
                if message[0] == "ok":
                    results[rank] = message[1]
                    continue
                _, text, tb, pickled_exc = message
                original: BaseException | None = None
                if pickled_exc is not None:
                    try:
                        original = pickle.loads(pickled_exc)
                    except Exception:
                        original = None
                failure = WorkerError(rank, text, remote_traceback=tb, exception=original)
                if not return_exceptions:
                    raise failure
                results[rank] = original if original is not None else failure
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for conn in conns:
            conn.close()
    return results
