"""A connection keeps being read while requests on it block, however many block in turn."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint.testing import run_workers

SECRET = {"RALLYPOINT_RPC_SECRET": "hand-over-secret"}
_GATE = threading.Event()
_STARTED = threading.Event()


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _until_next_request_starts(seconds: float) -> bool:
    return _STARTED.wait(seconds)


def _wait_for_gate(seconds: float) -> bool:
    _STARTED.set()  # ends the request before this one, a moment after this one began
    return _GATE.wait(seconds)


def _open_gate() -> None:
    _GATE.set()


def _ping() -> str:
    return str(rpc.get_worker_info().name)


_SERVED: list[threading.Thread] = []  # kept alive: their ids stay distinct


def _slow_here(seconds: float) -> None:
    _SERVED.append(threading.current_thread())
    time.sleep(seconds)


def _threads_served() -> int:
    return len({id(thread) for thread in _SERVED})


def _back_and_forth(to: str, n: int) -> int:
    """Calls from the callee back to the caller while the caller's request is running."""
    return sum(rpc.rpc_sync(to, _ping) == to for _ in range(n))


def _two_blocking_requests() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=30)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    if rank == 0:
        # a long request: the reader that runs it is replaced by a second reader
        first = rpc.rpc_async("w1", _until_next_request_starts, args=(8.0,))
        time.sleep(0.1)
        # the second reader runs a request that blocks until a later frame on the same
        # connection opens the gate; the first request ends just after it began
        gated = rpc.rpc_async("w1", _wait_for_gate, args=(8.0,))
        time.sleep(0.3)
        # a third reader must take this frame while the second one waits
        opened = rpc.rpc_async("w1", _open_gate)
        start = time.monotonic()
        out["gated"] = gated.wait()
        out["gated_s"] = time.monotonic() - start
        opened.wait()
        out["first"] = first.wait()
        # both directions keep flowing while a long request runs on w1
        long = rpc.rpc_async("w1", _slow, args=(1.0,))
        out["pings"] = rpc.rpc_sync("w1", _back_and_forth, args=("w0", 50))
        out["long"] = long.wait()
        # every one of these is handed over (30 ms > the 5 ms stall): the thread that kept
        # a request parks and serves a later hand-over, instead of a new thread each time
        # (a fresh thread builds torch's intra-op team again: slow model-parallel stages)
        for _ in range(20):
            rpc.rpc_sync("w1", _slow_here, args=(0.03,))
        out["threads"] = rpc.rpc_sync("w1", _threads_served)
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_a_request_that_blocks_after_a_hand_over_is_handed_over_again() -> None:
    out = run_workers(_two_blocking_requests, 2, timeout=45, env=SECRET)[0]
    assert out["gated"] is True, out  # False: the gate call was never read (deadlock)
    assert out["gated_s"] < 6.0, out  # not the 8 s the gated request waits at most
    assert out["first"] is True and out["long"] == 1.0
    assert out["pings"] == 50
    assert out["threads"] <= 4, out  # 20 without the reader pool
