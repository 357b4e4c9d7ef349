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


_REFUSE_THREADS = threading.Event()
_WARNINGS: list[str] = []


def _refuse_threads(refuse: bool) -> None:
    """While set, a hand-over cannot start its reader (as when the process is at its
    thread limit: ``RuntimeError: can't start new thread``); other readers start."""
    import logging
    import sys

    from rallypoint.rpc._transport import _connection as _transport

    if not _WARNINGS and not hasattr(_transport.Connection, "_real_spawn"):
        real = _transport.Connection._spawn_reader

        def spawn(self: Any, generation: int) -> None:
            if _REFUSE_THREADS.is_set() and sys._getframe(1).f_code.co_name == "check_stall":
                raise RuntimeError("can't start new thread")
            real(self, generation)

        _transport.Connection._real_spawn = real  # type: ignore[attr-defined]
        _transport.Connection._spawn_reader = spawn  # type: ignore[method-assign]
        handler = logging.Handler()
        handler.emit = lambda record: _WARNINGS.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("rallypoint.rpc").addHandler(handler)
    if refuse:
        _REFUSE_THREADS.set()
    else:
        _REFUSE_THREADS.clear()


def _warnings() -> list[str]:
    return _WARNINGS


def _hand_over_without_threads() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    out: dict[str, Any] = {}
    if rank == 0:
        rpc.rpc_sync("w1", _refuse_threads, args=(True,))
        slow = rpc.rpc_async("w1", _slow, args=(1.0,))
        time.sleep(0.2)  # the monitor has tried to hand the connection over, many times
        start = time.monotonic()
        try:  # read by the stuck reader once its request ends
            out["ping"] = rpc.rpc_sync("w1", _ping, timeout=6)
        except RuntimeError as exc:
            out["ping"] = repr(exc)
        out["ping_s"] = time.monotonic() - start
        out["slow"] = slow.wait()
        rpc.rpc_sync("w1", _refuse_threads, args=(False,))
        slow = rpc.rpc_async("w1", _slow, args=(1.0,))
        time.sleep(0.2)
        start = time.monotonic()
        out["ping_again"] = rpc.rpc_sync("w1", _ping, timeout=6)  # handed over again
        out["ping_again_s"] = time.monotonic() - start
        out["slow_again"] = slow.wait()
        out["warnings"] = rpc.rpc_sync("w1", _warnings)
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_a_hand_over_that_cannot_start_a_thread_leaves_the_connection_read() -> None:
    """A hand-over whose thread cannot start still leaves the connection a reader once
    the blocking request ended: every later frame on it is read."""
    out = run_workers(_hand_over_without_threads, 2, timeout=45, env=SECRET)[0]
    assert out["ping"] == "w1" and out["slow"] == 1.0, out
    assert 0.5 < out["ping_s"] < 3.0, out  # waited for the slow request, then was read
    assert out["ping_again"] == "w1" and out["ping_again_s"] < 0.5, out
    assert out["slow_again"] == 1.0
    assert len(out["warnings"]) == 1 and "could not start a reader" in out["warnings"][0], out
