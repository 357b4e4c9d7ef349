"""RRef lifetime (owner frees values when no RRef is left) and same-host shared memory."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint.rpc._agent._agent import current_rallypoint_agent

SECRET = {"RALLYPOINT_RPC_SECRET": "lifetime-secret"}
_KEEP: list[Any] = []


def _owned() -> int:
    return len(current_rallypoint_agent().rrefs)


def _keep(rref: Any) -> int:
    _KEEP.append(rref)
    return int(rref.to_here().sum().item())


def _drop() -> None:
    _KEEP.clear()
    gc.collect()


def _echo(x: Any) -> Any:
    return x


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _wait_owned(target: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = rpc.rpc_sync("worker1", _owned)
        if n == target or time.monotonic() > deadline:
            return int(n)
        time.sleep(0.02)


def _lifetime_scenario(mode: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(
        rpc_timeout=20, shared_memory=mode == "shm", unix_socket=mode != "tcp"
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    if rank == 0:
        local = rpc.RRef(torch.arange(4))
        assert local.is_owner() and local.owner_name() == "worker0"
        assert torch.equal(local.local_value(), torch.arange(4))
        assert torch.equal(local.to_here(), torch.arange(4))
        assert rpc.rpc_sync("worker2", _keep, args=(local,)) == 6  # fork of a local RRef
        rpc.rpc_sync("worker2", _drop)

        base = _wait_owned(0)
        rref = rpc.remote("worker1", torch.ones, args=([8],))  # torch: size is a list
        assert rref.to_here().sum().item() == 8
        assert rref.confirmed_by_owner()
        with pytest.raises(RuntimeError, match=r"can't call localValue\(\) on user .* on owner"):
            rref.local_value()
        out["owned_with_user"] = _wait_owned(base + 1)
        assert rpc.rpc_sync("worker2", _keep, args=(rref,)) == 8  # fork to a third worker
        del rref
        gc.collect()
        time.sleep(0.1)
        out["owned_after_creator_dropped"] = _wait_owned(base + 1)
        rpc.rpc_sync("worker2", _drop)
        out["owned_after_all_dropped"] = _wait_owned(base)

        big = torch.randn(1 << 20)  # 4 MiB
        before = dict(current_rallypoint_agent().stats)
        for _ in range(3):
            back = rpc.rpc_sync("worker1", _add_one, args=(big,))
            assert torch.equal(back, big + 1)
        after = current_rallypoint_agent().stats
        out["shm_bytes"] = after["shm_tensor_bytes"] - before["shm_tensor_bytes"]
        out["inline_bytes"] = after["inline_tensor_bytes"] - before["inline_tensor_bytes"]
        out["unix"] = sorted({c.uds for c in current_rallypoint_agent().connections.opened()})
        mutated = rpc.rpc_sync("worker1", _echo, args=(big,))
        mutated.zero_()  # the received tensor must not alias the sender's
        assert big.abs().sum() > 0
        params = torch.nn.Parameter(torch.ones(3))
        got = rpc.rpc_sync("worker1", _echo, args=(params,))
        assert isinstance(got, torch.nn.Parameter) and got.requires_grad
        assert torch.equal(
            rpc.rpc_sync("worker1", _echo, args=(torch.empty(0, 3),)), torch.empty(0, 3)
        )
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["shm", "unix", "tcp"])
def test_rref_lifetime_and_tensor_transport(mode: str) -> None:
    from rallypoint.testing import run_workers

    out = run_workers(_lifetime_scenario, 3, mode, timeout=50, env=SECRET)[0]
    assert out["unix"] == ([False] if mode == "tcp" else [True])
    assert out["owned_with_user"] == out["owned_after_creator_dropped"]
    assert out["owned_after_all_dropped"] == out["owned_with_user"] - 1
    size = 3 * (4 << 20)  # three 4 MiB requests sent by worker0
    if mode == "shm":
        assert out["shm_bytes"] == size and out["inline_bytes"] < 1024
    else:
        assert out["shm_bytes"] == 0 and out["inline_bytes"] >= size


def _reinit() -> list[int]:
    rank = int(os.environ["RANK"])
    out = []
    for i in range(3):
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
        out.append(rpc.rpc_sync(f"w{1 - rank}", max, args=(i, 0)))
        rpc.shutdown()
    return out


@pytest.mark.timeout(40)
def test_init_shutdown_cycles_in_one_process() -> None:
    from rallypoint.testing import run_workers

    assert run_workers(_reinit, 2, timeout=30, env=SECRET) == [[0, 1, 2], [0, 1, 2]]


def _init_method(init_method: str) -> str:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(init_method=init_method, rpc_timeout=20)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    name = str(rpc.rpc_sync(f"w{1 - rank}", rpc.get_worker_info).name)
    rpc.shutdown()
    return name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_tcp_and_file_init_methods(scheme: str, tmp_path: Any) -> None:
    from rallypoint._core.net import free_port
    from rallypoint.testing import run_workers

    init = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/store"
    assert run_workers(_init_method, 2, init, timeout=40, env=SECRET) == ["w1", "w0"]


_STORED: list[torch.Tensor] = []


def _store_and_echo(x: torch.Tensor) -> torch.Tensor:
    _STORED.append(x)
    return x


def _stored_sum() -> float:
    return float(sum(t.sum().item() for t in _STORED))


def _mutate_stored() -> None:
    for t in _STORED:
        t.fill_(-1)


def _forget_stored() -> None:
    _STORED.clear()
    gc.collect()


def _returned_bytes() -> int:
    return current_rallypoint_agent().stats["returned_tensor_bytes"]


def _twice_and_halves(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x, x, x[: x.numel() // 2], x[1:]


def _return_to_sender_scenario() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=20)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    if rank == 0:
        agent = current_rallypoint_agent()
        x = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
        expected = float(x.sum())
        before = rpc.rpc_sync("worker1", _returned_bytes)
        y = rpc.rpc_sync("worker1", _store_and_echo, args=(x,))
        out["returned"] = rpc.rpc_sync("worker1", _returned_bytes) - before
        out["equal"] = torch.equal(y, x)
        # neither side sees the other's writes, although no byte was copied back
        y.add_(1)
        out["callee_after_caller_wrote"] = rpc.rpc_sync("worker1", _stored_sum) == expected
        rpc.rpc_sync("worker1", _mutate_stored)
        out["caller_after_callee_wrote"] = torch.equal(y, x + 1)
        out["x_untouched"] = float(x.sum()) == expected
        del y
        rpc.rpc_sync("worker1", _forget_stored)
        gc.collect()
        # a tensor handed back twice in one reply, a prefix view, and an offset view
        a, b, half, tail = rpc.rpc_sync("worker1", _twice_and_halves, args=(x,))
        n = x.numel()
        out["pieces"] = [
            torch.equal(a, x),
            torch.equal(b, x),
            torch.equal(half, x[: n // 2]),
            torch.equal(tail, x[1:]),
        ]
        a.fill_(7)  # a and b are one object (pickle keeps identity, as in torch)
        # views of one storage in one message share it on arrival (TensorPipe's rule too,
        # see test_rpc_tensor_views.py); the caller's x is still never aliased
        out["pieces_share_a_storage"] = (
            a is b and bool((half == 7).all()) and bool((tail == 7).all())
        )
        out["x_still_untouched"] = float(x.sum()) == expected
        del a, b, half, tail
        gc.collect()
        # segments come back into use: many echoes need few segments
        for _ in range(20):
            y = rpc.rpc_sync("worker1", _echo, args=(x,))
            assert torch.equal(y, x)
            del y
        out["segments"] = len(agent._pool.segments()) if agent._pool else -1
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_a_tensor_sent_back_to_its_sender_is_not_copied_and_never_aliased() -> None:
    from rallypoint.testing import run_workers

    out = run_workers(_return_to_sender_scenario, 2, timeout=50, env=SECRET)[0]
    assert out["returned"] == 1 << 20, out  # handed back, not copied
    assert out["equal"] and out["x_untouched"]
    assert out["callee_after_caller_wrote"] and out["caller_after_callee_wrote"]
    assert out["pieces"] == [True] * 4 and out["pieces_share_a_storage"]
    assert out["x_still_untouched"]
    assert 0 < out["segments"] <= 4
