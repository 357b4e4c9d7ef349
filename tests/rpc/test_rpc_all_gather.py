"""torch's private RPC all-gather and barrier (``rpc.api._all_gather``, ``_barrier``,
``_wait_all_workers``), compared with torch's own in the same test: torch's functions on
torch's agent, rallypoint's on rallypoint's."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "all-gather-secret"}
_counts: dict[str, int] = {}  # per phase: a worker may start the next phase early
_count_lock = threading.Lock()


def _reset(phase: str) -> None:
    with _count_lock:
        _counts[phase] = 0


def _increment(phase: str) -> None:
    with _count_lock:
        _counts[phase] += 1


def _read(phase: str) -> int:
    return _counts.get(phase, 0)


class _SlowPickle:
    """Takes ``seconds`` to pickle and as long again to unpickle (torch's SlowPickleClass)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __getstate__(self) -> tuple[float]:
        time.sleep(self.seconds)
        return (self.seconds,)

    def __setstate__(self, state: tuple[float]) -> None:
        self.seconds = state[0]
        time.sleep(self.seconds)


def _api(backend: str) -> Any:
    if backend == "TENSORPIPE":
        import torch.distributed.rpc.api as torch_api

        return torch_api
    return rpc.api


def _barrier_counts(api: Any, names: list[str], me: str, phase: str) -> tuple[int, int]:
    """torch's barrier test: the leader's count before the first barrier and after the
    second, with each worker adding one in between."""
    names = sorted(names)
    leader = names[0]
    rpc.rpc_sync(leader, _reset, args=(phase,))
    before = _read(phase) if me == leader else -1
    api._barrier(names)
    rpc.rpc_sync(leader, _increment, args=(phase,))
    api._barrier(names)
    after = _read(phase) if me == leader else -1
    return before, after


def _program(backend: str) -> dict[str, Any]:
    rank, world_size = int(os.environ["RANK"]), 4
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=20)
    me = f"worker{rank}"
    rpc.init_rpc(me, backend=kind, rank=rank, world_size=world_size, rpc_backend_options=options)
    api = _api(backend)
    out: dict[str, Any] = {}
    try:
        out["gather"] = api._all_gather(rank)
        out["gather_again"] = api._all_gather(f"again {rank}")
        everyone = [f"worker{r}" for r in range(world_size)]
        out["barrier_all"] = _barrier_counts(api, everyone, me, "all")
        odd_or_even = [f"worker{r}" for r in range(world_size) if r % 2 == rank % 2]
        out["barrier_subset"] = _barrier_counts(api, odd_or_even, me, "subset")
        partial = odd_or_even if rank % 2 else [me]
        out["barrier_partial"] = _barrier_counts(api, partial, me, "partial")
        threads = [threading.Thread(target=api._barrier, args=(everyone,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        out["threads_done"] = not any(thread.is_alive() for thread in threads)
        api._wait_all_workers()
        out["after_wait_all"] = (
            rpc.rpc_sync(f"worker{(rank + 1) % world_size}", _read, args=("all",)) >= 0
        )
        rpc._set_rpc_timeout(0.1)
        try:
            api._all_gather(_SlowPickle(0.3))
            out["timeout"] = "no error"
        except RuntimeError as exc:
            out["timeout"] = str(exc)
        rpc._set_rpc_timeout(20)
        time.sleep(2.5)  # the leader's late messages arrive before the next call
        out["gather_after_timeout"] = api._all_gather(rank * 10)
    finally:
        rpc.shutdown()
    return out


@pytest.mark.timeout(240)
def test_all_gather_and_barrier_behave_as_torchs() -> None:
    seen = {
        b: runner_for(b)(_program, 4, b, timeout=100, env=ENV) for b in ("TENSORPIPE", "RALLYPOINT")
    }
    for backend, results in seen.items():
        for rank, out in enumerate(results):
            assert out["gather"] == {f"worker{r}": r for r in range(4)}, backend
            assert out["gather_again"] == {f"worker{r}": f"again {r}" for r in range(4)}
            leader_of_all = rank == 0
            assert out["barrier_all"] == ((0, 4) if leader_of_all else (-1, -1)), backend
            leads_subset = rank in (0, 1)
            assert out["barrier_subset"] == ((0, 2) if leads_subset else (-1, -1)), backend
            expected_partial = (0, 1) if rank % 2 == 0 else ((0, 2) if rank == 1 else (-1, -1))
            assert out["barrier_partial"] == expected_partial, (backend, rank)
            assert out["threads_done"] and out["after_wait_all"]
            # torch's texts: the leader names the followers, a follower's call timed out
            if rank == 0:
                assert "timed out in _all_gather after 0.10 seconds" in out["timeout"]
            else:
                assert "RPC ran for more than set timeout" in out["timeout"], out["timeout"]
            assert out["gather_after_timeout"] == {f"worker{r}": 10 * r for r in range(4)}


def _outsider() -> str:
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    try:
        rpc.api._all_gather(1, worker_names=["worker1"])  # worker1 alone: its own leader
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        rpc.shutdown()


@pytest.mark.timeout(60)
def test_an_all_gather_a_worker_is_not_part_of_is_refused() -> None:
    out = runner_for("RALLYPOINT")(_outsider, 2, timeout=40, env=ENV)
    assert out[0] == "worker0 calls an all-gather of ['worker1'] it is not part of"
    assert out[1] == "no error"
