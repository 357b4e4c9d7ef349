"""Distributed autograd with CUDA tensors (marked ``cuda``; skipped without a GPU): two
processes on cuda:0, worker 0 maps ``{0: 0}`` to worker 1, which has no map of its own.

RRef-based forward and backward (``remote`` + ``to_here``, and ``RRef.backward``), a
``RemoteModule`` on ``"w1/cuda:0"`` trained with ``DistributedOptimizer`` over its CUDA
parameters (to the numbers of the same model trained in one process), and an error in the
callee's backward on a GPU failing the caller at once.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from _gpu import need_gpus
from torch import nn

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import DistributedOptimizer, dist_autograd
from rallypoint.rpc.nn import RemoteModule
from rallypoint.testing import run_workers

ENV = {RPC_SECRET: "cuda-autograd"}


def _init() -> int:
    rank = int(os.environ["RANK"])
    options = rpc.RallypointRpcBackendOptions(rpc_timeout=60)
    if rank == 0:
        options.set_device_map("w1", {0: 0})
    torch.cuda.set_device(0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    return rank


def _mul_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).sum()


def _rrefs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _init() == 0:
        t = torch.ones(3, device="cuda:0", requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.remote("w1", torch.mul, args=(t, 2.0)).to_here()
            dist_autograd.backward(cid, [y.sum()])
            grad = dist_autograd.get_gradients(cid)[t]
            out["to_here"] = (str(y.device), str(grad.device), grad.cpu().tolist())
        with dist_autograd.context() as cid:
            rpc.remote("w1", _mul_sum, args=(t,)).backward(cid)
            grad = dist_autograd.get_gradients(cid)[t]
            out["rref_backward"] = (str(grad.device), grad.cpu().tolist())
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_rref_forward_and_backward_on_cuda() -> None:
    need_gpus(1)
    out = run_workers(_rrefs, 2, timeout=200, env=ENV)[0]
    assert out == {
        "to_here": ("cuda:0", "cuda:0", [2.0, 2.0, 2.0]),
        "rref_backward": ("cuda:0", [3.0, 3.0, 3.0]),
    }


class _Net(nn.Module):
    """A small model with fixed initial weights (the same in both processes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(12.0).view(3, 4) / 10)
            self.lin.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _params(module_rref: Any) -> list[list[float]]:
    return [p.detach().cpu().flatten().tolist() for p in module_rref.local_value().parameters()]


def _remote_module(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _init() == 0:
        remote = RemoteModule("w1/cuda:0", _Net)
        opt = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1)
        local = _Net().cuda()
        local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
        x = torch.linspace(-1, 1, 8, device="cuda:0").view(2, 4)
        for _ in range(steps):
            with dist_autograd.context() as cid:
                y = remote(x)
                out["output_device"] = str(y.device)
                dist_autograd.backward(cid, [(y * y).sum()])
                opt.step(cid)
            local_opt.zero_grad()
            (local(x) ** 2).sum().backward()
            local_opt.step()
        out["remote"] = rpc.rpc_sync("w1", _params, args=(remote.module_rref,))
        out["local"] = [p.detach().cpu().flatten().tolist() for p in local.parameters()]
        out["on"] = rpc.rpc_sync("w1", _param_devices, args=(remote.module_rref,))
    rpc.shutdown()
    return out


def _param_devices(module_rref: Any) -> list[str]:
    return [str(p.device) for p in module_rref.local_value().parameters()]


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_a_remote_module_on_cuda_trains_with_distributed_optimizer() -> None:
    need_gpus(1)
    out = run_workers(_remote_module, 2, 3, timeout=200, env=ENV)[0]
    assert out["output_device"] == "cuda:0" and out["on"] == ["cuda:0", "cuda:0"]
    for ours, one_process in zip(out["remote"], out["local"], strict=True):
        assert torch.allclose(torch.tensor(ours), torch.tensor(one_process), atol=1e-6)


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom on the GPU worker")


def _raises(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _Raises.apply(x)  # type: ignore[no-untyped-call]
    return out.sum()


def _remote_error() -> tuple[str, float] | None:
    out = None
    if _init() == 0:
        t = torch.ones(3, device="cuda:0", requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", _raises, args=(t,))
            t0 = time.monotonic()
            try:
                dist_autograd.backward(cid, [loss])
                out = ("no error", time.monotonic() - t0)
            except RuntimeError as exc:
                out = (str(exc), time.monotonic() - t0)
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_an_error_in_a_gpu_workers_backward_fails_the_caller_at_once() -> None:
    need_gpus(1)
    text, seconds = run_workers(_remote_error, 2, timeout=200, env=ENV)[0]
    # at once: far below the 60 s RPC timeout a lost error waits for (a loaded machine)
    assert "boom on the GPU worker" in text and seconds < 20.0, (text, seconds)
