"""Faults and bad input against the rallypoint backend: each a clear error, never a hang."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint.testing import WorkerError, run_workers

SECRET = {"RALLYPOINT_RPC_SECRET": "faults-secret"}


def _init(world_size: int = 3, **options: Any) -> int:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=20, **options)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    return rank


def _return_lock() -> Any:
    return threading.Lock()


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _die_soon() -> None:
    time.sleep(0.3)
    os._exit(3)


def _faults_scenario() -> dict[str, Any]:
    rank = _init()
    out: dict[str, Any] = {}
    if rank == 0:
        with pytest.raises(RuntimeError, match="Unknown destination worker 'nobody'"):
            rpc.rpc_sync("nobody", max, args=(1, 2))
        with pytest.raises(RuntimeError, match="Unknown destination worker rank 9"):
            rpc.rpc_sync(9, max, args=(1, 2))
        with pytest.raises(ValueError, match="Cannot get WorkerInfo"):
            rpc.rpc_sync(1.5, max, args=(1, 2))
        with pytest.raises(TypeError, match="function should be callable"):
            rpc.rpc_sync("worker1", 42)
        with pytest.raises(TypeError, match="args must be a tuple or list"):
            rpc.rpc_sync("worker1", max, args=3)
        with pytest.raises((TypeError, AttributeError)):  # unpicklable argument
            rpc.rpc_sync("worker1", max, args=(threading.Lock(), 1))
        with pytest.raises(TypeError, match="pickle"):  # unpicklable result
            rpc.rpc_sync("worker1", _return_lock)
        with pytest.raises(
            rpc.RpcTimeoutError, match=r"RPC ran for more than set timeout \(200 ms\)"
        ):
            rpc.rpc_sync("worker1", _slow, args=(2.0,), timeout=0.2)
        with pytest.raises(ValueError, match="timeout must be seconds"):
            rpc.rpc_sync("worker1", _slow, args=(0,), timeout=-5)
        assert rpc.rpc_sync("worker1", _slow, args=(0.01,), timeout=0) == 0.01
        assert rpc.rpc_sync(1, max, args=(4, 5)) == 5  # by rank
        assert rpc.rpc_sync(rpc.get_worker_info("worker2"), max, args=(4, 6)) == 6
        # a peer crash mid-call fails the pending future promptly, naming the peer
        pending = rpc.rpc_async("worker2", _slow, args=(30.0,))
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            rpc.rpc_sync("worker2", _die_soon)
        with pytest.raises(rpc.RpcConnectionError, match="worker2") as info:
            pending.wait()
        out["crash_detect_s"] = time.monotonic() - start
        assert info.value.peer == "worker2"
        with pytest.raises(rpc.RpcConnectionError, match="cannot reach worker worker2"):
            rpc.rpc_sync("worker2", max, args=(1, 2))
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2  # others keep working
    if rank == 2:
        time.sleep(60)  # killed by worker0's _die_soon call
    start = time.monotonic()
    try:
        rpc.shutdown(timeout=15)
    except rpc.RpcShutdownError as exc:
        out["missing"] = exc.missing
        out["message"] = str(exc)
    out["shutdown_s"] = time.monotonic() - start
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_sync("worker1", max, args=(1, 2))
    return out


@pytest.mark.timeout(60)
def test_faults_each_give_a_clear_error_and_never_hang() -> None:
    results = run_workers(_faults_scenario, 3, timeout=50, env=SECRET, return_exceptions=True)
    assert isinstance(results[2], WorkerError) and "exited with code 3" in str(results[2])
    assert results[0]["crash_detect_s"] < 10.0  # not the 30 s the call would take
    for rank in (0, 1):
        assert results[rank]["missing"] == ["worker2"], results[rank]
        assert "did not reach shutdown" in results[rank]["message"]
        assert results[rank]["shutdown_s"] < 12.0  # a known-dead peer ends the 15 s wait


def _duplicate_names() -> str:
    rank = int(os.environ["RANK"])
    with pytest.raises(RuntimeError, match="worker name 'dup' is used by ranks 0 and 1") as info:
        rpc.init_rpc("dup", rank=rank, world_size=2)
    return str(info.value)


def _missing_rank() -> str:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=1.0)
    with pytest.raises(RuntimeError, match=r"ranks \[2\] did not join within 1.0 s") as info:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    return str(info.value)


@pytest.mark.timeout(30)
def test_duplicate_names_and_missing_ranks_fail_init_on_every_worker() -> None:
    assert len(run_workers(_duplicate_names, 2, timeout=20, env=SECRET)) == 2
    assert len(run_workers(_missing_rank, 2, timeout=20, env=SECRET)) == 2


def _graceful_waits_for_outstanding_work() -> list[int]:
    rank = _init(world_size=2)
    got: list[int] = []
    if rank == 0:
        futs = [rpc.rpc_async("worker1", _slow, args=(0.2,)) for _ in range(5)]
        futs[0].then(lambda f: got.append(1))
    rpc.shutdown()  # rank 1 must keep serving until rank 0's calls are done
    if rank == 0:
        assert all(f.done() and f.value() == 0.2 for f in futs)
    return got


@pytest.mark.timeout(30)
def test_graceful_shutdown_waits_for_outstanding_calls() -> None:
    assert run_workers(_graceful_waits_for_outstanding_work, 2, timeout=20, env=SECRET)[0] == [1]


_GATE = threading.Event()


def _wait_for_gate() -> bool:
    return _GATE.wait(10)


def _open_gate() -> None:
    _GATE.set()


def _ping_pong(depth: int) -> int:
    if depth == 0:
        return 0
    me = rpc.get_worker_info().name
    other = "worker1" if me == "worker0" else "worker0"
    return 1 + int(rpc.rpc_sync(other, _ping_pong, args=(depth - 1,)))


def _blocking_scenario() -> dict[str, Any]:
    rank = _init(world_size=2)
    out: dict[str, Any] = {}
    if rank == 0:
        # the first call blocks worker1's reader until a later call on the same connection
        # opens the gate: the reader must hand over instead of deadlocking
        blocked = rpc.rpc_async("worker1", _wait_for_gate)
        time.sleep(0.05)
        rpc.rpc_sync("worker1", _open_gate)
        out["gate"] = blocked.wait()
        out["depth"] = rpc.rpc_sync("worker1", _ping_pong, args=(8,))
        with pytest.raises(RuntimeError, match=r"must return a torch\.futures\.Future object"):
            rpc.rpc_sync("worker1", _not_async_but_marked)
    rpc.shutdown()
    return out


@rpc.functions.async_execution
def _not_async_but_marked() -> int:
    return 1


@pytest.mark.timeout(40)
def test_blocking_and_nested_calls_do_not_deadlock() -> None:
    out = run_workers(_blocking_scenario, 2, timeout=30, env=SECRET)[0]
    assert out == {"gate": True, "depth": 8}


def _late_worker() -> dict[str, Any]:
    rank = _init(world_size=2)
    out: dict[str, Any] = {}
    if rank == 1:
        time.sleep(2.5)  # alive, but reaches shutdown long after worker0 gave up
    start = time.monotonic()
    try:
        rpc.shutdown(timeout=1.0)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
        out["missing"] = getattr(exc, "missing", None)
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.timeout(40)
def test_graceful_shutdown_gives_up_after_its_timeout_naming_missing_workers() -> None:
    results = run_workers(_late_worker, 2, timeout=30, env=SECRET)
    assert results[0]["missing"] == ["worker1"]
    assert "gave up after 1.0 s" in results[0]["error"]
    assert 0.9 < results[0]["seconds"] < 15.0  # bounded: no hang
    assert "lost the rendezvous store" in results[1]["error"]  # no hang either
    assert results[1]["seconds"] < 15.0
