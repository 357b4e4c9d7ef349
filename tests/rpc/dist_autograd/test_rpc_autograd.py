"""rallypoint's distributed autograd where it goes beyond torch's, or where only it can be seen.

Compared with torch in the same run: errors before ``init_rpc``. rallypoint only: a send
whose gradient never comes (torch hangs), a worker that keeps a received tensor, contexts
on several threads, releases on every worker, no recording outside a context, gradients
that skip a pipeline's driver, and a worker that dies during the backward pass.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.rpc.dist_autograd._autograd import CURRENT_AUTOGRAD
from rallypoint.testing import run_workers

ENV = {RPC_SECRET: "autograd-secret"}
_KEPT: list[torch.Tensor] = []


def _keep(x: torch.Tensor) -> None:
    _KEPT.append(x)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _contexts() -> int:
    from rallypoint.rpc._agent._agent import current_rallypoint_agent

    return len(current_rallypoint_agent().autograd)


def _wait_for_no_contexts(worker: str) -> int:
    deadline = time.monotonic() + 5
    while (n := rpc.rpc_sync(worker, _contexts)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(n)


def _init(world_size: int) -> int:
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    return rank


def _unused_and_kept() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _init(2) == 0:
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as cid:
            rpc.rpc_sync("w1", _double, args=(w,))  # its result is never used
            t0 = time.monotonic()
            dist_autograd.backward(cid, [(w * 5).sum()])
            out["unused"] = (dist_autograd.get_gradients(cid)[w].tolist(), time.monotonic() - t0)
        with dist_autograd.context() as cid:
            h = w * 3  # used in the loss and sent to a worker that only keeps it
            rpc.rpc_sync("w1", _keep, args=(h,))
            dist_autograd.backward(cid, [(h * h).sum()])
            out["kept"] = dist_autograd.get_gradients(cid)[w].tolist()
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_sends_whose_gradient_never_comes_do_not_hang() -> None:
    out = run_workers(_unused_and_kept, 2, timeout=50, env=ENV)[0]
    grad, seconds = out["unused"]
    assert grad == [5.0, 5.0] and seconds < 5  # torch's FAST mode waits forever here
    assert out["kept"] == [18.0, 36.0]  # d/dw (3w)^2 = 18 w


def _threads_and_releases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _init(3) == 0:
        out["outside"] = rpc.rpc_sync("w1", _double, args=(torch.ones(1, requires_grad=True),))
        out["contexts after plain calls"] = [_contexts(), rpc.rpc_sync("w1", _contexts)]
        results: dict[int, Any] = {}

        def train(i: int) -> None:
            w = torch.full((2,), float(i + 1), requires_grad=True)
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync(f"w{1 + i % 2}", _double, args=(w,))
                time.sleep(0.05)  # the contexts overlap
                dist_autograd.backward(cid, [(y * y).sum()])
                results[i] = (cid, dist_autograd.get_gradients(cid)[w].tolist())

        threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["threads"] = results
        out["left"] = [_contexts(), _wait_for_no_contexts("w1"), _wait_for_no_contexts("w2")]
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_contexts_per_thread_and_released_everywhere() -> None:
    out = run_workers(_threads_and_releases, 3, timeout=50, env=ENV)[0]
    assert out["outside"].requires_grad and out["outside"].grad_fn is None
    assert out["contexts after plain calls"] == [0, 0]
    ids = {cid for cid, _ in out["threads"].values()}
    assert len(ids) == 4
    for i, (_, grad) in out["threads"].items():
        assert grad == [8.0 * (i + 1)] * 2  # d/dw (2w)^2 = 8w
    assert out["left"] == [0, 0, 0]


class _Lin(torch.nn.Linear):
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        super().__init__(4, 4)


def _stage(module: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.tanh(module.local_value()(x))
    return out


def _stage_grads(module: Any, context_id: int) -> list[torch.Tensor]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module.local_value().parameters()]


def _pipelines() -> dict[str, Any]:
    """A driver passes each stage's output to the next stage (torch's model-parallel
    tutorials): every gradient of a passed-on tensor skips the driver."""
    out: dict[str, Any] = {}
    if _init(4) == 0:
        from rallypoint.rpc._agent._agent import current_rallypoint_agent

        autograd = current_rallypoint_agent().autograd
        served: list[int] = []
        serve = autograd.serve
        autograd.serve = lambda *a: served.append(1) or serve(*a)  # type: ignore[method-assign]
        stages = [rpc.remote(f"w{r}", _Lin, args=(r,)) for r in (1, 2, 3)]
        x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_(True)
        for name in ("through the driver", "also used by the driver"):
            with dist_autograd.context() as cid:
                hs = [x]
                for r, stage in zip((1, 2, 3), stages, strict=True):
                    hs.append(rpc.rpc_sync(f"w{r}", _stage, args=(stage, hs[-1])))
                loss = (hs[-1] ** 2).sum() + (hs[1].sum() if name != "through the driver" else 0)
                served.clear()
                dist_autograd.backward(cid, [loss])
                got = [dist_autograd.get_gradients(cid)[x]]
                for r, stage in zip((1, 2, 3), stages, strict=True):
                    got += rpc.rpc_sync(f"w{r}", _stage_grads, args=(stage, cid))
                out[name] = (len(served), got)
        local = [_Lin(r) for r in (1, 2, 3)]
        for name in ("through the driver", "also used by the driver"):
            xr = x.detach().requires_grad_(True)
            hs = [xr]
            for module in local:
                hs.append(torch.tanh(module(hs[-1])))
            loss = (hs[-1] ** 2).sum() + (hs[1].sum() if name != "through the driver" else 0)
            params = [p for module in local for p in module.parameters()]
            out[name + ": one process"] = list(torch.autograd.grad(loss, [xr, *params]))
    rpc.shutdown()
    return out


@pytest.mark.timeout(90)
def test_gradients_that_only_pass_through_the_driver_skip_it() -> None:
    out = run_workers(_pipelines, 4, timeout=80, env=ENV)[0]
    for name in ("through the driver", "also used by the driver"):
        torch.testing.assert_close(out[name][1], out[name + ": one process"])
    # The driver serves the gradient of x (its leaf). torch's FAST mode (and rallypoint
    # before routes) sends the gradients of h1 and h2 back through it too: 3 propagations.
    # h1, which the driver also uses, needs its pass there.
    assert out["through the driver"][0] == 1
    assert out["also used by the driver"][0] == 2


class _Die(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        os._exit(3)


def _dies_in_backward(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _Die.apply(x)  # type: ignore[no-untyped-call]
    return out


def _slow_double(x: torch.Tensor) -> torch.Tensor:
    class _Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(2.0)
            return grad * 2

    out: torch.Tensor = _Slow.apply(x)  # type: ignore[no-untyped-call]
    return out


def _concurrent_backward() -> str | None:
    message = None
    if _init(2) == 0:
        w = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("w1", _slow_double, args=(w,))
            first = threading.Thread(target=dist_autograd.backward, args=(cid, [y.sum()], True))
            first.start()
            running = CURRENT_AUTOGRAD.get()._waiters  # the passes that run, by (context, round)
            deadline = time.monotonic() + 20
            while not any(key[0] == cid for key in list(running)):  # the first pass began
                assert time.monotonic() < deadline, "the first backward pass never began"
                time.sleep(0.01)
            try:
                dist_autograd.backward(cid, [y.sum()])
            except RuntimeError as exc:
                message = str(exc)
            first.join()
    rpc.shutdown()
    return message


@pytest.mark.timeout(60)
def test_a_second_backward_while_one_runs_in_the_context_is_refused() -> None:
    message = run_workers(_concurrent_backward, 2, timeout=50, env=ENV)[0]
    assert message is not None and "is already running" in message


def _worker_dies() -> str | None:
    rank = _init(2)
    if rank == 1:
        time.sleep(30)  # dies in the backward pass long before this
        return None
    w = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("w1", _dies_in_backward, args=(w,))
        try:
            dist_autograd.backward(cid, [y.sum()])
        except RuntimeError as exc:
            message = str(exc)
    rpc.shutdown(graceful=False)
    return message


@pytest.mark.timeout(60)
def test_a_worker_dying_in_the_backward_pass_fails_it_naming_the_worker() -> None:
    out = run_workers(_worker_dies, 2, timeout=50, env=ENV, return_exceptions=True)
    assert isinstance(out[0], str), out
    assert "w1" in out[0] and "died during the distributed backward pass" in out[0]


def test_before_init_rpc_errors_are_torchs_type_and_name_init_rpc() -> None:
    torch_autograd: Any = importlib.import_module("torch.distributed.autograd")
    with pytest.raises(RuntimeError) as theirs:
        torch_autograd.context().__enter__()
    prefix = "Need to initialize distributed autograd"
    assert str(theirs.value).startswith(prefix)
    t = torch.ones(1, requires_grad=True)
    for call in (
        lambda: dist_autograd.context().__enter__(),
        lambda: dist_autograd.backward(0, [t.sum()]),
        lambda: dist_autograd.get_gradients(0),
    ):
        with pytest.raises(RuntimeError, match=prefix) as ours:
            call()
        assert "rallypoint.rpc.init_rpc" in str(ours.value)
    assert dist_autograd.is_available()


def test_bad_arguments_are_type_errors_as_in_torch() -> None:
    t = torch.ones(1, requires_grad=True)
    with pytest.raises(TypeError, match="context_id must be an int"):
        dist_autograd.backward("x", [t.sum()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="roots must be a sequence of tensors"):
        dist_autograd.backward(0, t.sum())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="context_id must be an int"):
        dist_autograd.get_gradients(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retain_graph must be a bool"):
        dist_autograd.backward(0, [t.sum()], retain_graph="yes")  # type: ignore[arg-type]
