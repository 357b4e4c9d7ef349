"""PendingCalls: the caller's bookkeeping of outstanding calls, without processes."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
import torch

from rallypoint.rpc._agent._calls import PendingCalls, fail
from rallypoint.rpc._errors import RpcError, RpcTimeoutError
from rallypoint.rpc._transport._connection import Connection


class _Conn:
    def __init__(self, name: str) -> None:
        self.peer_name = name
        self.pending: dict[int, torch.futures.Future[Any]] = {}


def _future() -> torch.futures.Future[Any]:
    return torch.futures.Future()


def _conn(name: str) -> Connection:
    return cast(Connection, _Conn(name))


def test_reply_completes_once_and_timeouts_name_the_peer_and_duration() -> None:
    calls = PendingCalls(default_timeout=0.05)
    conn = _conn("worker1")
    replied, defaulted, custom, untimed = (_future() for _ in range(4))
    calls.add(1, conn, replied, 0.05)
    calls.add(2, conn, defaulted, 0.05)
    before_custom = time.monotonic()  # custom's deadline comes 0.2 s after this, or later
    calls.add(3, conn, custom, 0.2)
    calls.add(4, conn, untimed, 0)
    assert calls.pop(1) is replied and calls.pop(1) is None
    calls.expire(before_custom + 0.1)
    with pytest.raises(RpcTimeoutError, match=r"\(50 ms\).*call to worker1"):
        defaulted.wait()
    assert not custom.done()
    calls.expire(time.monotonic() + 0.3)
    with pytest.raises(RpcTimeoutError, match=r"\(200 ms\)"):
        custom.wait()
    calls.expire(time.monotonic() + 3600)
    assert not untimed.done() and list(conn.pending) == [4] and bool(calls)
    assert calls.pop(2) is None  # a late reply after the timeout finds nothing


def test_a_new_default_timeout_applies_to_new_calls_and_old_ones_keep_theirs() -> None:
    calls = PendingCalls(default_timeout=60)
    conn = _conn("worker1")
    old, new = _future(), _future()
    calls.add(1, conn, old, 60)  # heads the FIFO with a deadline an hour away
    calls.set_default(0.05)  # rpc._set_rpc_timeout
    calls.add(2, conn, new, 0.05)
    calls.expire(time.monotonic() + 0.1)
    assert new.done()  # not stuck behind the older call's later deadline
    with pytest.raises(RpcTimeoutError, match=r"\(50 ms\)"):
        new.wait()
    assert not old.done()
    calls.expire(time.monotonic() + 61)
    with pytest.raises(RpcTimeoutError, match=r"\(60000 ms\)"):
        old.wait()


def test_broken_connection_and_shutdown_fail_only_their_calls() -> None:
    calls = PendingCalls(default_timeout=60)
    a, b = _conn("a"), _conn("b")
    fa, fb = _future(), _future()
    calls.add(1, a, fa, 60)
    calls.add(2, b, fb, 60)
    calls.fail_connection(a, RpcError("a broke"))
    with pytest.raises(RpcError, match="a broke"):
        fa.wait()
    assert not fb.done()
    calls.fail_all()
    with pytest.raises(RpcError, match="RPC to b was cancelled"):
        fb.wait()
    assert not calls and not a.pending and not b.pending


def test_completed_calls_do_not_pile_up_behind_a_long_one() -> None:
    calls = PendingCalls(default_timeout=60)
    conn = _conn("w")
    calls.add(0, conn, torch.futures.Future(), 60)  # still pending: heads the FIFO
    calls.add(1, conn, torch.futures.Future(), 30)  # per-call timeout: in the heap
    for rid in range(2, 5000):
        calls.add(rid, conn, torch.futures.Future(), 60 if rid % 2 else 30)
        calls.pop(rid)
    calls.expire(time.monotonic())
    assert len(calls._fifo) <= 2 * len(calls.owners) + 1024
    assert len(calls._heap) <= 2 * len(calls.owners) + 1024
    assert sorted(calls.owners) == [0, 1]


def test_fail_on_the_cpp_future_that_rpc_async_returns() -> None:
    # rpc_async returns torch._C.Future (as torch's does), which has no set_exception
    future: Any = torch._C.Future([])
    seen = future.then(lambda f: f.wait())
    fail(future, KeyError("gone"))
    with pytest.raises(KeyError, match="gone"):
        future.wait()
    with pytest.raises(RuntimeError, match="KeyError: 'gone'"):  # as torch wraps callbacks
        seen.wait()
    fail(future, ValueError("ignored"))  # already complete: no effect
    with pytest.raises(KeyError):
        future.value()
