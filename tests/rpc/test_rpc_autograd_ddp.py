"""DDP modules inside a rallypoint distributed backward: all-reduced context gradients.

Under torch, DDP's reducer runs during ``dist_autograd.backward`` and writes the
averaged gradients of its parameters into the context. rallypoint's backward must give
the same, leave ``.grad`` alone, and fail clearly where the reducer cannot finish.
(The full DDP+RPC program against torch: test_rpc_program_ddp.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing._workers import run_workers


class _OneUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _remote_double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _averaged(ddp: DDP, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """The reference: the local gradients (no DDP), all-reduced and averaged."""
    params = list(ddp.module.parameters())
    grads = torch.autograd.grad((ddp.module(x) * 2 * w.detach()).sum(), params)
    out = []
    for grad in grads:
        grad = grad.clone()
        dist.all_reduce(grad)
        out.append(grad / dist.get_world_size())
    return out


def _checks(rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    ddp = DDP(torch.nn.Linear(3, 2))
    w = torch.nn.Parameter(torch.randn(2))  # a plain leaf next to the DDP ones
    sentinels = {p: torch.full_like(p, 7.0) for p in [*ddp.parameters(), w]}
    for p, s in sentinels.items():
        p.grad = s
    out: dict[str, Any] = {"grads": [], "w": []}
    for step in range(2):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * step + rank))
        expected = _averaged(ddp, x, w)
        with dist_autograd.context() as context_id:
            # the DDP output goes to the other worker and comes back: one local pass here
            y = rpc.rpc_sync(f"w{1 - rank}", _remote_double, args=(ddp(x),))
            dist_autograd.backward(context_id, [(y * w).sum()])
            grads = dist_autograd.get_gradients(context_id)
        got = [grads[p] for p in ddp.parameters()]
        out["grads"].append(all(torch.allclose(g, e) for g, e in zip(got, expected, strict=True)))
        local_w = (ddp.module(x) * 2).detach().sum(0)
        out["w"].append(torch.allclose(grads[w], local_w))
    out["grad_untouched"] = all(p.grad is s and bool((s == 7).all()) for p, s in sentinels.items())
    unused = DDP(_OneUnused())
    with dist_autograd.context() as context_id:
        try:
            dist_autograd.backward(context_id, [unused(torch.ones(1, 3)).sum()])
        except RuntimeError as exc:
            out["unused"] = str(exc)
    out["unused_grad_none"] = all(p.grad is None for p in unused.parameters())
    return out


def _worker() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    try:
        return _checks(rank)
    finally:
        rpc.shutdown()
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_ddp_gradients_in_the_context_are_all_reduced_and_grad_is_untouched() -> None:
    results = run_workers(_worker, 2, timeout=60, env={RPC_SECRET: "ddp"})
    for result in results:
        assert "did not finish in the local pass" in result.pop("unused")
        assert result == {
            "grads": [True, True],
            "w": [True, True],
            "grad_untouched": True,
            "unused_grad_none": True,
        }
