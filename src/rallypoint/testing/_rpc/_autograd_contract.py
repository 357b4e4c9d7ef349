"""The distributed autograd contract: what every RPC backend's dist_autograd must do.

``run_rpc_autograd_contract(backend)`` starts three forked workers with ``backend`` and
runs, through ``rallypoint.rpc.dist_autograd`` and ``DistributedOptimizer``, the patterns
programs use: model-parallel stages, nested calls and calls back to the caller, several
backward passes in one context, torch's errors for misuse, a tensor both used and sent,
errors in a remote backward, sparse gradients, and a few training steps of a small
model-parallel model. Every gradient is checked against a single-process reference; the
function returns what it saw, so that a test can compare backends with each other exactly.
A failed check raises, naming it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing._workers import run_reference_workers, run_workers

_W = ("worker0", "worker1", "worker2")


class Stage(torch.nn.Module):
    """``tanh(linear(x))`` with parameters drawn from ``seed``."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in, generator=generator) / d_in)
        self.bias = torch.nn.Parameter(torch.randn(d_out, generator=generator) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t() + self.bias)


class Cell(torch.nn.Module):
    """An RNN cell: ``tanh(wx(e) + wh(h))``."""

    def __init__(self, d_in: int, d_hidden: int, seed: int) -> None:
        super().__init__()
        self.wx = Stage(d_in, d_hidden, seed)
        generator = torch.Generator().manual_seed(seed + 100)
        self.wh = torch.nn.Parameter(torch.randn(d_hidden, d_hidden, generator=generator) / 4)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.wx(e) + h @ self.wh.t())


# ---- functions that run on the workers ---------------------------------------------------
def _forward(module: Any, *args: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module.local_value()(*args)
    return out


def _forward_fetched(module: Any, x_rref: Any) -> torch.Tensor:
    out: torch.Tensor = module.local_value()(x_rref.to_here())
    return out


def _param_rrefs(module: Any) -> list[Any]:
    from rallypoint import rpc

    return [rpc.RRef(p) for p in module.local_value().parameters()]


def _params(module: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.local_value().parameters()]


def _grads(module: Any, context_id: int) -> list[torch.Tensor | None]:
    from rallypoint.rpc import dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module.local_value().parameters()]


def _sparse_embedding(seed: int) -> torch.nn.Embedding:
    weights = torch.randn(10, 3, generator=torch.Generator().manual_seed(seed))
    table = torch.nn.Embedding(10, 3, sparse=True)
    with torch.no_grad():
        table.weight.copy_(weights)
    return table


def _sparse_scaled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b) * 3


def _scaled_through(to: str, module: Any, x: torch.Tensor) -> torch.Tensor:
    from rallypoint import rpc

    out: torch.Tensor = rpc.rpc_sync(to, _forward, args=(module, x)) * 3
    return out


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in backward")


def _boom(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _Boom.apply(x)  # type: ignore[no-untyped-call]
    return out


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class PlainSGD(torch.optim.Optimizer):
    """An optimizer torch has no functional version of: it reads ``.grad``."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _context_rank(context_id: int) -> int:
    return context_id >> 48


# ---- the checks --------------------------------------------------------------------------
class _Checks:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.done: list[str] = []
        self.seen: dict[str, Any] = {}

    def close(self, name: str, actual: Any, expected: Any) -> None:
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as exc:
            raise AssertionError(f"{self.backend}: contract check {name!r} failed: {exc}") from exc
        self.seen[name] = actual
        self.done.append(name)

    def true(self, name: str, condition: bool) -> None:
        if not condition:
            raise AssertionError(f"{self.backend}: contract check {name!r} failed")
        self.done.append(name)

    def error(self, name: str, func: Callable[[], Any]) -> None:
        try:
            func()
        except Exception as exc:
            kind = type(exc).__name__
            # TensorPipe prefixes the type of a remote RuntimeError to its text
            first = str(exc).split("\n")[0].removeprefix(f"{kind}: ")
            self.seen[name] = (kind, first)
            self.done.append(name)
            return
        raise AssertionError(f"{self.backend}: contract check {name!r} raised nothing")


def _reference(x: torch.Tensor, head: torch.nn.Module, loss_of: Callable[..., Any]) -> Any:
    """Gradients of the same model in one process: (x, head, stage 1, stage 2)."""
    s1, s2 = Stage(4, 5, 1), Stage(5, 3, 2)
    x = x.detach().requires_grad_(True)
    loss = loss_of(head(s2(s1(x))), x)
    inputs = [x, *head.parameters(), *s1.parameters(), *s2.parameters()]
    return torch.autograd.grad(loss, inputs)


def _two_stage(c: _Checks, rpc: Any, dist_autograd: Any, fetch: bool) -> None:
    s1 = rpc.remote(_W[1], Stage, args=(4, 5, 1))
    s2 = rpc.remote(_W[2], Stage, args=(5, 3, 2))
    head = Stage(3, 2, 3)
    x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_(True)

    def loss_of(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (y * y).sum() + x.sum()

    name = "to_here" if fetch else "rpc_sync"
    with dist_autograd.context() as cid:
        if fetch:
            h_rref = rpc.remote(_W[1], _forward, args=(s1, x))
            y = rpc.remote(_W[2], _forward_fetched, args=(s2, h_rref)).to_here()
        else:
            h = rpc.rpc_sync(_W[1], _forward, args=(s1, x))
            y = rpc.rpc_sync(_W[2], _forward, args=(s2, h))
        dist_autograd.backward(cid, [loss_of(head(y), x)])
        local = dist_autograd.get_gradients(cid)
        got = [local[x], *(local[p] for p in head.parameters())]
        got += rpc.rpc_sync(_W[1], _grads, args=(s1, cid))
        got += rpc.rpc_sync(_W[2], _grads, args=(s2, cid))
        c.true(f"{name}: gradients only in the context", x.grad is None)
    c.close(f"{name}: gradients equal one process", got, list(_reference(x, head, loss_of)))


def _nested_and_callback(c: _Checks, rpc: Any, dist_autograd: Any) -> None:
    s1 = rpc.remote(_W[1], Stage, args=(4, 5, 1))
    s2 = rpc.remote(_W[2], Stage, args=(5, 3, 2))
    s0 = rpc.RRef(Stage(5, 3, 2))
    x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_(True)
    ref = Stage(5, 3, 2)
    for name, target in (("nested A->B->C", _W[2]), ("callback A->B->A", _W[0])):
        module = s2 if target == _W[2] else s0
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(_W[1], _forward, args=(s1, x))
            y = rpc.rpc_sync(_W[1], _scaled_through, args=(target, module, h))
            dist_autograd.backward(cid, [y.sum()])
            got = [dist_autograd.get_gradients(cid)[x]]
            if target == _W[2]:
                got += rpc.rpc_sync(_W[2], _grads, args=(s2, cid))
            else:
                grads = dist_autograd.get_gradients(cid)
                got += [grads[p] for p in s0.local_value().parameters()]
        xr = x.detach().requires_grad_(True)
        loss = (ref(Stage(4, 5, 1)(xr)) * 3).sum()
        c.close(name, got, list(torch.autograd.grad(loss, [xr, *ref.parameters()])))


def _shared(c: _Checks, rpc: Any, dist_autograd: Any) -> None:
    """A tensor used in the loss and also sent: its node runs once, with both gradients."""
    s1 = rpc.remote(_W[1], Stage, args=(5, 3, 1))
    local = Stage(4, 5, 2)
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    with dist_autograd.context() as cid:
        h = local(x)
        y = rpc.rpc_sync(_W[1], _forward, args=(s1, h))
        loss = y.sum() + (h * h).sum() + (local.weight * 2).sum()
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        got = [grads[p] for p in local.parameters()]
        got += rpc.rpc_sync(_W[1], _grads, args=(s1, cid))
    ref1 = Stage(5, 3, 1)
    h = local(x)
    loss = ref1(h).sum() + (h * h).sum() + (local.weight * 2).sum()
    c.close(
        "a tensor used here and sent",
        got,
        list(torch.autograd.grad(loss, [*local.parameters(), *ref1.parameters()])),
    )
    with dist_autograd.context() as cid:
        t = torch.ones(2, requires_grad=True)
        y = rpc.rpc_sync(_W[1], _boom, args=(t,))
        c.error("an error in a remote backward", lambda: dist_autograd.backward(cid, [y.sum()]))
    with dist_autograd.context() as cid:  # its gradient skips this worker (rallypoint)
        t = torch.ones(2, requires_grad=True)
        h = rpc.rpc_sync(_W[1], _boom, args=(t,))
        y = rpc.rpc_sync(_W[2], _double, args=(h,))
        text = ""
        try:
            dist_autograd.backward(cid, [y.sum()])
        except RuntimeError as exc:
            text = str(exc).split("\n")[0]
        # torch's text names every hop ("Error on Node 0: Error on Node 2: Error on Node 0:
        # Error on Node 1: boom"), or only the failing one when its failure notice reaches
        # the caller first: a race, so only both ends are compared
        c.true(
            "an error in a remote backward, two stages",
            text.startswith("Error on Node 0: ") and text.endswith("Node 1: boom in backward"),
        )


def _accumulate(c: _Checks, rpc: Any, dist_autograd: Any) -> None:
    s1 = rpc.remote(_W[1], Stage, args=(4, 5, 1))
    x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_(True)
    with dist_autograd.context() as cid:
        loss = (rpc.rpc_sync(_W[1], _forward, args=(s1, x)) ** 2).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        x_grad = dist_autograd.get_gradients(cid)[x]
        once = [x_grad.clone(), *rpc.rpc_sync(_W[1], _grads, args=(s1, cid))]
        dist_autograd.backward(cid, [loss])
        twice = [dist_autograd.get_gradients(cid)[x], *rpc.rpc_sync(_W[1], _grads, args=(s1, cid))]
        c.close("two passes accumulate", twice, [2 * g for g in once])
        c.close("a gradient read earlier sees the second pass (in place)", x_grad, twice[0])
        c.error("backward after the graph was freed", lambda: dist_autograd.backward(cid, [loss]))
    xr = x.detach().requires_grad_(True)
    s = Stage(4, 5, 1)
    ref = torch.autograd.grad((s(xr) ** 2).sum(), [xr, *s.parameters()])
    c.close("one pass equals one process", once, list(ref))


def _sparse(c: _Checks, rpc: Any, dist_autograd: Any) -> None:
    """Sparse gradients: an embedding with ``sparse=True`` on another worker, trained with
    ``DistributedOptimizer`` (a parameter server's pattern), and sparse tensors that
    require grad sent as arguments and returned."""
    table = rpc.remote(_W[1], _sparse_embedding, args=(7,))
    opt = rpc.DistributedOptimizer(
        torch.optim.SGD, rpc.rpc_sync(_W[1], _param_rrefs, args=(table,)), lr=0.5
    )
    local = _sparse_embedding(7)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.5)
    grads = []
    for idx in (torch.tensor([[1, 4, 4], [0, 9, 1]]), torch.tensor([[2, 4]])):
        with dist_autograd.context() as cid:
            rows = rpc.rpc_sync(_W[1], _forward, args=(table, idx))
            dist_autograd.backward(cid, [(rows * rows).sum()])
            grads += rpc.rpc_sync(_W[1], _grads, args=(table, cid))
            opt.step(cid)
        local_opt.zero_grad()
        (local(idx) * local(idx)).sum().backward()
        grads.append(local.weight.grad.clone())  # type: ignore[union-attr]
        local_opt.step()
    c.true("sparse: an embedding's gradient is sparse", grads[0].layout == torch.sparse_coo)
    c.close("sparse: an embedding's gradients equal one process", grads[0::2], grads[1::2])
    params = rpc.rpc_sync(_W[1], _params, args=(table,))
    c.close("sparse: DistributedOptimizer steps equal one process", params, [local.weight])
    indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
    a = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    b = torch.sparse_coo_tensor(indices[:, :2], torch.tensor([4.0, 5.0]), (2, 3))
    a.requires_grad_(True)
    b.requires_grad_(True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync(_W[2], _sparse_scaled, args=(a, b))
        c.true("sparse: a returned sparse tensor requires grad", out.requires_grad)
        dist_autograd.backward(cid, [torch.sparse.sum(out)])
        got = [dist_autograd.get_gradients(cid)[t] for t in (a, b)]
    ref = torch.autograd.grad(torch.sparse.sum(_sparse_scaled(a, b)), [a, b])
    c.close("sparse: gradients of sparse arguments equal one process", got, list(ref))


def _errors(c: _Checks, rpc: Any, dist_autograd: Any) -> None:
    t = torch.ones(2, requires_grad=True)
    c.error("backward: unknown context", lambda: dist_autograd.backward(12345, [t.sum()]))
    c.error("get_gradients: unknown context", lambda: dist_autograd.get_gradients(12345))
    c.true("context ids name their worker", rpc.rpc_sync(_W[1], _new_context_rank) == 1)
    with dist_autograd.context() as cid:
        c.true("context id names the worker", _context_rank(cid) == 0)
        c.error("a call in a context runs in it", lambda: rpc.rpc_sync(_W[1], _new_context_rank))
        c.error("nested context", lambda: dist_autograd.context().__enter__())
        c.error("root without grad", lambda: dist_autograd.backward(cid, [torch.ones(1)]))
        c.error("root not a scalar", lambda: dist_autograd.backward(cid, [t * 2]))
        leaf = torch.tensor(3.0, requires_grad=True)
        c.error("root is a leaf", lambda: dist_autograd.backward(cid, [leaf]))
        c.error("no roots", lambda: dist_autograd.backward(cid, []))
        c.error("roots not tensors", lambda: dist_autograd.backward(cid, [1.0]))
        c.true("empty gradients", dist_autograd.get_gradients(cid) == {})
    c.error("get_gradients after the context", lambda: dist_autograd.get_gradients(cid))
    out = rpc.rpc_sync(_W[1], torch.mul, args=(t, 2))
    c.true("outside a context nothing is recorded", out.requires_grad and out.grad_fn is None)


def _new_context_rank() -> int:
    from rallypoint.rpc import dist_autograd

    with dist_autograd.context() as cid:
        return _context_rank(cid)


# ---- training ----------------------------------------------------------------------------
def _data(steps: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (
            torch.randn(length, 2, 4, generator=generator),
            torch.randn(length, 2, 3, generator=generator),
        )
        for _ in range(steps)
    ]


def _optimizer(name: str) -> tuple[Any, dict[str, float]]:
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.5}
    if name == "plain":
        return PlainSGD, {"lr": 0.1}
    return torch.optim.Adam, {"lr": 0.01}


def _train(rpc: Any, dist_autograd: Any, name: str, steps: int = 3) -> dict[str, Any]:
    emb = rpc.remote(_W[1], Stage, args=(4, 6, 5))
    cell = rpc.remote(_W[2], Cell, args=(6, 5, 6))
    head = Stage(5, 3, 7)
    params = rpc.rpc_sync(_W[1], _param_rrefs, args=(emb,))
    params += rpc.rpc_sync(_W[2], _param_rrefs, args=(cell,))
    params += [rpc.RRef(p) for p in head.parameters()]
    cls, kwargs = _optimizer(name)
    opt = rpc.DistributedOptimizer(cls, params, **kwargs)
    try:
        opt.step(12345)
    except RuntimeError as exc:
        if "Could not find autograd context with id: 12345" not in str(exc):
            raise
    else:
        raise AssertionError("DistributedOptimizer.step accepted an unknown context")
    losses = []
    for xs, ys in _data(steps, 4):
        with dist_autograd.context() as cid:
            h = torch.zeros(2, 5)
            loss = torch.zeros(())
            for t in range(len(xs)):
                if t % 2:
                    e = rpc.rpc_sync(_W[1], _forward, args=(emb, xs[t]))
                else:
                    e = rpc.remote(_W[1], _forward, args=(emb, xs[t])).to_here()
                h = rpc.rpc_sync(_W[2], _forward, args=(cell, e, h))
                loss = loss + ((head(h) - ys[t]) ** 2).mean()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        losses.append(loss.item())
    final = rpc.rpc_sync(_W[1], _params, args=(emb,)) + rpc.rpc_sync(_W[2], _params, args=(cell,))
    return {"losses": losses, "params": final + [p.detach().clone() for p in head.parameters()]}


def train_reference(name: str, steps: int = 3) -> dict[str, Any]:
    """The training run of the contract in one process, with the local optimizer."""
    emb, cell, head = Stage(4, 6, 5), Cell(6, 5, 6), Stage(5, 3, 7)
    params = [*emb.parameters(), *cell.parameters(), *head.parameters()]
    cls, kwargs = _optimizer(name)
    opt = cls(params, **kwargs)
    losses = []
    for xs, ys in _data(steps, 4):
        h = torch.zeros(2, 5)
        loss = torch.zeros(())
        for t in range(len(xs)):
            h = cell(emb(xs[t]), h)
            loss = loss + ((head(h) - ys[t]) ** 2).mean()
        opt.zero_grad()
        torch.autograd.backward([loss])
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in params]}


def _worker(backend: str) -> dict[str, Any] | None:
    from rallypoint import rpc
    from rallypoint.rpc import dist_autograd

    rank = int(os.environ["RANK"])
    options = rpc.construct_rpc_backend_options(rpc.BackendType[backend], rpc_timeout=60)
    kind = rpc.BackendType[backend]
    rpc.init_rpc(_W[rank], backend=kind, rank=rank, world_size=3, rpc_backend_options=options)
    out: dict[str, Any] | None = None
    try:
        if rank == 0:
            c = _Checks(backend)
            _two_stage(c, rpc, dist_autograd, fetch=False)
            _two_stage(c, rpc, dist_autograd, fetch=True)
            _nested_and_callback(c, rpc, dist_autograd)
            _shared(c, rpc, dist_autograd)
            _accumulate(c, rpc, dist_autograd)
            _sparse(c, rpc, dist_autograd)
            _errors(c, rpc, dist_autograd)
            out = {"checks": c.done, "seen": c.seen}
            names = ("sgd", "adam", "plain")
            out["train"] = {name: _train(rpc, dist_autograd, name) for name in names}
    finally:
        rpc.shutdown()
    if rank == 0 and backend == "TENSORPIPE":
        # rank 0 hosts the store: torch's shutdown can return here while another rank is
        # still in its final store barrier, which then fails if this process is gone
        time.sleep(0.5)
    return out


def run_rpc_autograd_contract(
    backend: str, *, timeout: float = 120.0, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run the contract against ``backend`` in three fresh worker processes.

    Returns rank 0's record: ``checks`` (names, in order), ``seen`` (gradients and
    errors by check name) and ``train`` (losses and final parameters per optimizer).
    """
    extra = {RPC_SECRET: "autograd-contract-secret", **(env or {})}
    run = run_reference_workers if backend == "TENSORPIPE" else run_workers
    result: dict[str, Any] = run(_worker, 3, backend, timeout=timeout, env=extra)[0]
    return result
