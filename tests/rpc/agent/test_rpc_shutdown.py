"""Graceful shutdown waits while the peers are alive and fails promptly when one is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint.testing import WorkerError, run_workers
from rallypoint.testing._workers import runner_for

SECRET = {"RALLYPOINT_RPC_SECRET": "shutdown-secret"}


def _step(i: int) -> int:
    return i + 1


_READY = threading.Event()


def _ready() -> bool:
    return _READY.is_set()


def _wait_until_everyone_started(rank: int) -> None:
    """Every other worker's init_rpc returned (its connections are all set up)."""
    deadline = time.monotonic() + 20
    for other in (r for r in range(3) if r != rank):
        while not rpc.rpc_sync(f"w{other}", _ready) and time.monotonic() < deadline:
            time.sleep(0.01)


def _init(backend: str, rpc_timeout: float, world_size: int = 3) -> int:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    opts = rpc.construct_rpc_backend_options(kind, rpc_timeout=rpc_timeout)
    rpc.init_rpc(
        f"w{rank}", backend=kind, rank=rank, world_size=world_size, rpc_backend_options=opts
    )
    _READY.set()
    return rank


_KEEP_CALLING_TIMEOUT = 3.0
_CALLING_CAP_S = 30.0
"""The master gives up calling after this long (the workers never all entered shutdown)."""
_ENTERED: list[float] = []  # this worker's time of entering shutdown(), once it did


def _entered_at() -> float | None:
    return _ENTERED[0] if _ENTERED else None


def _master_keeps_calling(backend: str) -> dict[str, Any]:
    """Workers wait in shutdown() while the master calls them for longer than rpc_timeout.

    Times are ``time.monotonic()`` readings, one clock for every process on the machine,
    so a worker's stay in shutdown() is compared with the master's work directly. The
    master works on until every worker has been in shutdown() for longer than rpc_timeout
    (it asks them when they entered): how much later one process got going after init_rpc
    (a loaded machine) cannot matter, and nobody waits for a fixed span.
    """
    rank = _init(backend, rpc_timeout=_KEEP_CALLING_TIMEOUT)
    out: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        calls = 0
        while time.monotonic() - start < _CALLING_CAP_S:
            entered = []
            for worker in ("w1", "w2"):
                calls += rpc.rpc_sync(worker, _step, args=(0,))
                entered.append(rpc.rpc_sync(worker, _entered_at))
            if None not in entered and time.monotonic() - max(entered) > _KEEP_CALLING_TIMEOUT:
                break
            time.sleep(0.02)
        out["calls"] = calls
        out["work_ended"] = time.monotonic()
    _ENTERED.append(time.monotonic())
    out["entered"] = _ENTERED[0]
    rpc.shutdown()
    out["left"] = time.monotonic()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["RALLYPOINT", "TENSORPIPE"])
def test_workers_wait_in_shutdown_while_the_master_works_longer_than_rpc_timeout(
    backend: str,
) -> None:
    run = runner_for(backend)
    results = run(_master_keeps_calling, 3, backend, timeout=45, env=SECRET)
    assert results[0]["calls"] > 20
    work_ended = results[0]["work_ended"]
    for out in results[1:]:
        # the master worked on for longer than rpc_timeout after this worker entered
        # shutdown(), and the worker stayed there until the master was done: it waited
        # for the master (and exited cleanly, or run_workers would raise)
        assert work_ended - out["entered"] > _KEEP_CALLING_TIMEOUT, (out, work_ended)
        assert out["left"] >= work_ended, (out, work_ended)


def _killed_in_shutdown(victim_sleeps: float) -> dict[str, Any]:
    rank = _init("RALLYPOINT", rpc_timeout=60)  # the default: promptness is not the timeout
    out: dict[str, Any] = {}
    if rank == 2:
        _wait_until_everyone_started(rank)
        time.sleep(victim_sleeps)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        rpc.shutdown()
        out["error"] = None
    except rpc.RpcShutdownError as exc:
        out["error"] = str(exc)
        out["missing"] = exc.missing
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.timeout(60)
def test_a_peer_killed_while_the_others_wait_in_shutdown_is_named_promptly() -> None:
    results = run_workers(
        _killed_in_shutdown, 3, 1.0, timeout=45, env=SECRET, return_exceptions=True
    )
    assert isinstance(results[2], WorkerError) and "SIGKILL" in str(results[2])
    for out in results[:2]:
        assert out["missing"] == ["w2"], out
        assert "w2" in out["error"] and "did not reach shutdown" in out["error"]
        assert out["seconds"] < 30.0, out  # not the 60 s RPC timeout (a loaded machine)


WAKE_CAP_S = 30
"""The frozen worker is woken up at the latest after this long (else: once both others
have left shutdown())."""


def _frozen_in_shutdown(directory: str) -> dict[str, Any]:
    rank = _init("RALLYPOINT", rpc_timeout=2)
    out: dict[str, Any] = {}
    if rank == 2:
        # alive but unreachable (a helper process wakes it up once the others have left
        # shutdown(), or after WAKE_CAP_S), then gone
        _wait_until_everyone_started(rank)
        pid = os.getpid()
        left = " ".join(os.path.join(directory, f"left-{r}") for r in (0, 1))
        wake = (
            f"i=0; while [ $i -lt {WAKE_CAP_S * 20} ]; do ok=1; for f in {left}; do "
            '[ -e "$f" ] || ok=0; done; [ $ok = 1 ] && break; i=$((i+1)); sleep 0.05; done; '
            f"kill -CONT {pid}"
        )
        subprocess.Popen(["sh", "-c", wake])
        os.kill(pid, signal.SIGSTOP)
        os._exit(0)
    start = time.monotonic()
    try:
        rpc.shutdown()
        out["error"] = None
    except rpc.RpcShutdownError as exc:
        out["error"] = str(exc)
        out["missing"] = exc.missing
    out["seconds"] = time.monotonic() - start
    with open(os.path.join(directory, f"left-{rank}"), "w"):
        pass
    return out


@pytest.mark.timeout(60)
def test_a_peer_that_stops_answering_is_named_after_the_probe_timeout(tmp_path: Path) -> None:
    results = run_workers(
        _frozen_in_shutdown, 3, str(tmp_path), timeout=50, env=SECRET, return_exceptions=True
    )
    assert isinstance(results[2], WorkerError)
    for out in results[:2]:
        assert out["missing"] == ["w2"], out
        assert "did not answer" in out["error"], out
        # the probe's 5 s (~5.6 s in all here), not the frozen worker waking up (which it
        # does only after both have left shutdown, or after WAKE_CAP_S)
        assert out["seconds"] < WAKE_CAP_S - 0.5, out
