"""``torch.futures.wait_all`` raises at the first failed call, on both backends alike.

torch's ``wait_all`` exits early when a call on its agent fails (a remote error, a
timeout) while others still run. The same program runs on both backends: a call that
raises ``ValueError`` on the callee and one that times out, each beside a call that runs
for 4 s. Both backends must raise the failed call's error well before the slow call
ends; on TENSORPIPE, torch's own function (not the wrapper) is measured too. A Python
future failed with ``set_exception`` still makes ``wait_all`` wait for the others, as
torch's does.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import _wait_all
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "wait-all-secret"}
BACKENDS = ("RALLYPOINT", "TENSORPIPE")
SLOW_S = 4.0


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _raises(text: str) -> None:
    raise ValueError(text)


def _timed(wait_all: Any, futures: list[Any]) -> tuple[tuple[str, ...], str, float]:
    """What ``wait_all(futures)`` raised (its type and the type's bases, by name; its
    text) and after how many seconds."""
    started = time.monotonic()
    try:
        wait_all(futures)
    except Exception as exc:  # the type is what is compared
        kinds = tuple(kind.__name__ for kind in type(exc).__mro__)
        return kinds, str(exc), time.monotonic() - started
    return (), "", time.monotonic() - started


def _program(backend: str) -> dict[str, tuple[tuple[str, ...], str, float]] | None:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=20)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    out = None
    try:
        if rank == 0:
            functions = {"wrapped": torch.futures.wait_all}
            if backend == "TENSORPIPE":
                functions["torch"] = _wait_all.TORCH_WAIT_ALL
            out = {}
            slow_calls = []  # left running meanwhile; together they take SLOW_S
            for name, wait_all in functions.items():
                slow = rpc.rpc_async("w1", _slow, args=(SLOW_S,))
                failed = rpc.rpc_async("w1", _raises, args=("Expected error",))
                out[f"{name} remote error"] = _timed(wait_all, [slow, failed])
                slow_calls.append(slow)
                slow = rpc.rpc_async("w1", _slow, args=(SLOW_S,))
                late = rpc.rpc_async("w1", _slow, args=(SLOW_S,), timeout=0.5)
                out[f"{name} timeout"] = _timed(wait_all, [slow, late])
                slow_calls.append(slow)
            assert [slow.wait() for slow in slow_calls] == [SLOW_S] * len(slow_calls)
    finally:
        rpc.shutdown()
    return out


@pytest.mark.timeout(240)
def test_wait_all_raises_at_the_first_failed_call_on_both_backends() -> None:
    seen = {
        backend: runner_for(backend)(_program, 2, backend, timeout=120, env=ENV)[0]
        for backend in BACKENDS
    }
    ours, torchs = seen["RALLYPOINT"], seen["TENSORPIPE"]
    assert ours is not None and torchs is not None
    for result in (*ours.values(), *torchs.values()):
        assert result[0], result  # every wait raised
        assert result[2] < SLOW_S / 2, result  # ... long before the slow call ended
    for case in ("remote error", "timeout"):
        torch_kind = torchs[f"torch {case}"][0]
        assert torchs[f"wrapped {case}"][0] == torch_kind, (case, torchs)
        # rallypoint's error is torch's type (a timeout: RpcTimeoutError, a RuntimeError)
        assert torch_kind[0] in ours[f"wrapped {case}"][0], (case, ours, torchs)
    assert ours["wrapped remote error"][0][0] == "ValueError"
    assert "Expected error" in ours["wrapped remote error"][1]


@pytest.mark.timeout(60)
def test_a_python_future_failed_by_the_program_still_waits_for_the_others_as_in_torch() -> None:
    def run(wait_all: Any) -> tuple[tuple[str, ...], str, float]:
        failed: torch.futures.Future[Any] = torch.futures.Future()
        failed.set_exception(ValueError("set by the program"))
        slow: torch.futures.Future[Any] = torch.futures.Future()
        timer = threading.Timer(0.5, slow.set_result, args=(1,))
        timer.start()
        try:
            return _timed(wait_all, [failed, slow])
        finally:
            timer.join()

    assert torch.futures.wait_all is _wait_all.wait_all  # importing rallypoint.rpc wrapped it
    for wait_all in (torch.futures.wait_all, _wait_all.TORCH_WAIT_ALL):
        kind, text, seconds = run(wait_all)
        assert (kind[0], text) == ("ValueError", "set by the program")
        assert seconds >= 0.4, wait_all  # it waited for the slow future, as torch's


@pytest.mark.timeout(60)
def test_wait_all_checks_its_argument_as_torchs() -> None:
    for bad in (None, [1, 2], "futures"):
        errors = []
        for wait_all in (torch.futures.wait_all, _wait_all.TORCH_WAIT_ALL):
            try:
                wait_all(bad)  # type: ignore[arg-type]
            except Exception as exc:
                errors.append((type(exc), str(exc)))
        assert len(errors) == 2 and errors[0] == errors[1], (bad, errors)
