"""The agent's ``get_metrics()`` / ``get_debug_info()``: torch's keys, and the same counts
as torch's TensorPipe agent for the same program (both backends run in the test)."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint.testing import run_workers

SECRET = {"RALLYPOINT_RPC_SECRET": "debug-info-secret"}
_started = threading.Event()
_release = threading.Event()
_measured = threading.Event()
_pending: list[torch.futures.Future[Any]] = []


def _block() -> int:
    _started.set()
    _release.wait(30)
    return 1


@rpc.functions.async_execution
def _later() -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    _pending.append(fut)
    _started.set()
    return fut


def _wait_started() -> bool:
    return _started.wait(30)


def _finish() -> None:
    _started.clear()
    _release.set()
    while _pending:
        _pending.pop().set_result(2)


def _measuring_done() -> None:
    _measured.set()


def _info() -> dict[str, str]:
    return dict(rpc.api._get_current_rpc_agent().get_debug_info())


def _settled(read: Any, key: str, want: str) -> dict[str, str]:
    """A snapshot once ``key`` reads ``want`` (torch updates its counters on its own
    threads, a moment after the future completes); the last one after 2 s."""
    info: dict[str, str] = read()
    for _ in range(100):
        if info[key] == want:
            break
        time.sleep(0.02)
        info = read()
    return info


def _program(backend: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    options = rpc.construct_rpc_backend_options(
        rpc.BackendType[backend], rpc_timeout=60, num_worker_threads=5
    )
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType[backend],
        rank=rank,
        world_size=2,
        rpc_backend_options=options,
    )
    out: dict[str, Any] = {}
    if rank == 0:
        agent = rpc.api._get_current_rpc_agent()
        # torch's init may still be serving worker1's last call of its startup exchange
        out["idle"] = _settled(agent.get_debug_info, "agent.server_active_calls", "0")
        out["metrics"] = _settled(agent.get_metrics, "agent.server_active_calls", "0")
        remote_info = functools.partial(rpc.rpc_sync, "worker1", _info)
        for name, func in (("sync", _block), ("async", _later)):
            fut = rpc.rpc_async("worker1", func)
            assert rpc.rpc_sync("worker1", _wait_started)
            out[f"{name}_caller"] = _settled(agent.get_debug_info, "agent.client_active_calls", "1")
            # the callee counts the call that asks, too; an async call is counted as waiting
            # once its function has returned the future, a moment after it said it started
            # (with the machine loaded, ours was read in between once)
            if name == "async":
                out[f"{name}_callee"] = _settled(
                    remote_info, "agent.server_active_async_calls", "1"
                )
            else:
                out[f"{name}_callee"] = remote_info()
            rpc.rpc_sync("worker1", _finish)
            assert fut.wait() in (1, 2)
        out["callee_after"] = _settled(remote_info, "agent.server_active_calls", "1")
        rpc.rpc_sync("worker1", _measuring_done)
    else:
        # worker1 stays out of shutdown() until worker0 has measured: shutdown's gather
        # is a call worker1 -> worker0, and torch's counters show it for a while
        assert _measured.wait(60)
    rpc.shutdown()
    return out


@pytest.mark.timeout(120)
def test_debug_info_has_torchs_keys_and_counts() -> None:
    torchs = run_workers(_program, 2, "TENSORPIPE", timeout=100, env=SECRET)[0]
    ours = run_workers(_program, 2, "RALLYPOINT", timeout=100, env=SECRET)[0]
    assert set(torchs["idle"]) == {
        "agent.server_active_async_calls",
        "agent.client_active_calls",
        "agent.server_active_calls",
        "agent.num_idle_threads",
        "agent.thread_pool_size",
    }
    assert torchs["idle"]["agent.thread_pool_size"] == "5"  # num_worker_threads
    assert torchs["sync_callee"]["agent.server_active_calls"] == "2"  # the test is not empty
    assert torchs["async_callee"]["agent.server_active_async_calls"] == "1"
    assert ours == torchs
