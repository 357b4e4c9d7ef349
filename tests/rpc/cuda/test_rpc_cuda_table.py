"""CUDA tensors over RPC, rallypoint against TensorPipe in the same test (marked ``cuda``;
skipped without a GPU): two processes share cuda:0, worker 0 maps ``{0: 0}`` to worker 1,
which has only the reverse map.

Each row, on both backends: a mapped ``rpc_sync`` of a CUDA tensor; an unmapped CUDA
tensor from worker 1 refused with torch's words, naming ``set_device_map``; the
distributed backward pass through ``rpc_sync("w1", torch.mul, args=(t, 2.0))`` gives
``[2, 2, 2]`` on cuda:0 (it hung on rallypoint, its gradient refused on the way back);
a 64 MiB CUDA echo, correct, and on rallypoint (CUDA IPC on one host) within twice
TensorPipe's time.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
import torch
from _gpu import need_gpus

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "cuda-table"}
BACKENDS = ("TENSORPIPE", "RALLYPOINT")
ECHO_FLOATS = 16 << 20  # 64 MiB of float32


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _init(backend: str) -> int:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=60)
    if rank == 0:
        options.set_device_map("w1", {0: 0})
    torch.cuda.set_device(0)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    return rank


def _echo_ms(rounds: int) -> tuple[float, bool]:
    x = torch.rand(ECHO_FLOATS, device="cuda:0")
    for _ in range(3):
        rpc.rpc_sync("w1", _echo, args=(x,))
    times = []
    same = True
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = rpc.rpc_sync("w1", _echo, args=(x,))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        same = same and y.device == x.device and bool(torch.equal(y, x))
        del y
    return statistics.median(times) * 1e3, same


def _rows(backend: str) -> dict[str, Any]:
    rank = _init(backend)
    out: dict[str, Any] = {}
    if rank == 0:
        y = rpc.rpc_sync("w1", torch.add, args=(torch.arange(3.0, device="cuda:0"), 1))
        out["mapped"] = (str(y.device), y.cpu().tolist())
        t = torch.ones(3, device="cuda:0", requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", torch.mul, args=(t, 2.0)).sum()
            t0 = time.monotonic()
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[t]
            out["backward"] = (str(grad.device), grad.cpu().tolist(), time.monotonic() - t0)
        out["echo_ms"], out["echo_same"] = _echo_ms(20)
    else:
        try:
            rpc.rpc_sync("w0", torch.add, args=(torch.ones(2, device="cuda:0"), 1))
            out["unmapped"] = "sent"
        except RuntimeError as exc:
            out["unmapped"] = str(exc)
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_the_issues_table_on_both_backends() -> None:
    need_gpus(1)
    seen: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        w0, w1 = runner_for(backend)(_rows, 2, backend, timeout=300, env=ENV)
        seen[backend] = {**w0, **w1}
    for backend, rows in seen.items():
        assert rows["mapped"] == ("cuda:0", [1.0, 2.0, 3.0]), (backend, rows)
        assert "`set_device_map`" in rows["unmapped"], (backend, rows)
        assert "TensorPipe RPC backend only supports CPU tensors by default" in rows["unmapped"]
        device, grad, seconds = rows["backward"]
        assert (device, grad) == ("cuda:0", [2.0, 2.0, 2.0]), (backend, rows)
        assert seconds < 5.0, (backend, seconds)
        assert rows["echo_same"], backend
    ours, theirs = seen["RALLYPOINT"]["echo_ms"], seen["TENSORPIPE"]["echo_ms"]
    assert ours <= 2 * theirs, f"64 MiB echo: rallypoint {ours:.2f} ms, TensorPipe {theirs:.2f} ms"
