"""Distributed autograd cases found by running torch's own DistAutogradTest against rallypoint.

Each case runs on both backends in the same test and the results are compared with
torch's TensorPipe run and with one process: a leaf's ``register_hook`` when its gradient
comes straight back from another worker, sparse gradients (``EmbeddingBag(sparse=True)``)
accumulated over several passes, locally and through another worker, ``@torch.jit.script``
functions as call targets (torch sends them by qualified name), when a context copies a
gradient (one gradient given to two leaves: both get a copy), post hooks on a leaf's
``AccumulateGrad`` node (the engine's leaves and a gradient that comes straight back), and
the ``TypeError`` text of bad arguments.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "torch-suite-secret"}
_INPUT = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
_OFFSETS = torch.tensor([0, 4])


def _same(x: torch.Tensor) -> torch.Tensor:
    return x * 1


def _embedding() -> torch.nn.EmbeddingBag:
    torch.manual_seed(0)
    return torch.nn.EmbeddingBag(10, 3, sparse=True)


def _hooked(rpc_: Any, autograd: Any) -> list[list[float]]:
    t1 = torch.ones(3, 3, requires_grad=True)
    t1.register_hook(lambda grad: grad * 2)
    t2 = torch.ones(3, 3, requires_grad=True)
    with autograd.context() as cid:
        # t1 is sent as it is: its gradient comes back from w1 straight to the leaf
        loss = rpc_.rpc_sync("w1", torch.matmul, args=(t1, t2)).sum()
        autograd.backward(cid, [loss])
        grads: list[list[float]] = autograd.get_gradients(cid)[t1].tolist()
    return grads


def _sparse(rpc_: Any, autograd: Any, remote: bool, passes: int = 3) -> list[list[float]]:
    emb = _embedding()
    with autograd.context() as cid:
        out = emb(_INPUT, _OFFSETS)
        if remote:
            out = rpc_.rpc_sync("w1", _same, args=(out,))
        loss = out.sum()
        for _ in range(passes):
            autograd.backward(cid, [loss], retain_graph=True)
        grad = autograd.get_gradients(cid)[emb.weight]
        assert grad.is_sparse
        dense: list[list[float]] = grad.to_dense().tolist()
    return dense


@torch.jit.script
def _scripted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, y).tanh()


def _script_targets(rpc_: Any, autograd: Any) -> dict[str, Any]:
    """A ``@torch.jit.script`` function as the target of each call kind, in a context."""
    t1 = torch.linspace(-1, 1, 9).reshape(3, 3).requires_grad_()
    t2 = torch.eye(3, requires_grad=True)
    with autograd.context() as cid:
        a = rpc_.rpc_sync("w1", _scripted, args=(t1, t2))
        b = rpc_.rpc_async("w1", _scripted, args=(t2,), kwargs={"y": t1}).wait()
        c = rpc_.remote("w1", _scripted, args=(t1, t1)).to_here()
        autograd.backward(cid, [(a + b * c).sum()])
        grads = autograd.get_gradients(cid)
        return {
            "values": [v.tolist() for v in (a, b, c)],
            "grads": [grads[t1].tolist(), grads[t2].tolist()],
            "node": a.grad_fn.name(),
            "node_type": type(a.grad_fn).__name__,
            "repr": repr(a),
        }


def _post_hooks(rpc_: Any, autograd: Any) -> list[Any]:
    """torch's test_post_hooks, plus a leaf whose gradient comes straight back from w1:
    every ``AccumulateGrad`` post hook runs once per pass, with ``((), (grad,))``."""
    calls: list[Any] = []

    def hook(name: str) -> Any:
        def record(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            calls.append((name, len(grad_inputs), [g.sum().item() for g in grad_outputs]))

        return record

    t = torch.ones(2, 2, requires_grad=True)
    u = torch.ones(2, 2, requires_grad=True)
    a = t + t  # both edges of a's node reach t's one AccumulateGrad node
    b = u * 3
    a.grad_fn.next_functions[0][0].register_hook(hook("t1"))  # type: ignore[union-attr]
    a.grad_fn.next_functions[1][0].register_hook(hook("t2"))  # type: ignore[union-attr]
    u_node = b.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    removed = u_node.register_hook(hook("removed"))
    u_node.register_hook(hook("u"))
    removed.remove()
    with autograd.context() as cid:
        sent_back = rpc_.rpc_sync("w1", _same, args=(u,))  # u's gradient comes straight back
        autograd.backward(cid, [a.sum() + (b * sent_back).sum()])
        grads = autograd.get_gradients(cid)
        calls.append(("grads", grads[t].sum().item(), grads[u].sum().item(), t.grad, u.grad))
    return calls


class _Fork(torch.autograd.Function):
    """``a + b`` whose backward hands the same gradient tensor to both inputs."""

    seen: list[int] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _Fork.seen.append(grad.data_ptr())
        return grad, grad


class _Pass(torch.autograd.Function):
    seen: list[int] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Pass.seen.append(grad.data_ptr())
        return grad


def _grad_copies(autograd: Any) -> dict[str, bool]:
    """torch's rule for when a context keeps a gradient as it is and when it copies it."""
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    with autograd.context() as cid:
        autograd.backward(cid, [_Fork.apply(a, b)[1][0]])
        grads = autograd.get_gradients(cid)
        shared = {
            "a_is_b": grads[a].data_ptr() == grads[b].data_ptr(),
            "a_kept": grads[a].data_ptr() == _Fork.seen[-1],
            "b_kept": grads[b].data_ptr() == _Fork.seen[-1],
        }
    with autograd.context() as cid:
        autograd.backward(cid, [_Pass.apply(a)[1][0]])
        alone = autograd.get_gradients(cid)[a].data_ptr() == _Pass.seen[-1]
    return {**shared, "alone_kept": alone}


def _worker(backend: str) -> dict[str, Any] | None:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=30)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] | None = None
    try:
        if rank == 0:
            out = {
                "hooked": _hooked(rpc, dist_autograd),
                "sparse_local": _sparse(rpc, dist_autograd, remote=False),
                "sparse_remote": _sparse(rpc, dist_autograd, remote=True),
                "script": _script_targets(rpc, dist_autograd),
                "copies": _grad_copies(dist_autograd),
                "post_hooks": _post_hooks(rpc, dist_autograd),
            }
        else:  # one process, plain autograd (never in the pytest process: a process that
            # ran a backward pass must not fork workers that run one)
            emb = _embedding()
            emb(_INPUT, _OFFSETS).sum().backward()
            assert emb.weight.grad is not None
            out = {"reference": (emb.weight.grad.to_dense() * 3).tolist()}  # three passes
    finally:
        rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for backend in ("RALLYPOINT", "TENSORPIPE"):
        first, second = runner_for(backend)(_worker, 2, backend, timeout=90, env=ENV)
        out[backend] = {**first, **second}
    return out


@pytest.mark.timeout(200)
def test_leaf_hooks_run_when_the_gradient_comes_from_another_worker(
    runs: dict[str, dict[str, Any]],
) -> None:
    assert runs["RALLYPOINT"]["hooked"] == runs["TENSORPIPE"]["hooked"] == [[6.0] * 3] * 3


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["sparse_local", "sparse_remote"])
def test_sparse_gradients_accumulate_as_in_torch(
    runs: dict[str, dict[str, Any]], case: str
) -> None:
    reference = runs["RALLYPOINT"]["reference"]
    assert runs["RALLYPOINT"][case] == runs["TENSORPIPE"][case]
    torch.testing.assert_close(torch.tensor(runs["RALLYPOINT"][case]), torch.tensor(reference))


@pytest.mark.timeout(200)
def test_torchscript_functions_are_call_targets_as_in_torch(
    runs: dict[str, dict[str, Any]],
) -> None:
    ours, theirs = runs["RALLYPOINT"]["script"], runs["TENSORPIPE"]["script"]
    assert ours["node"] == theirs["node"] == "torch::distributed::autograd::RecvRpcBackward"
    # a received tensor prints as torch's: grad_fn=<RecvRpcBackward>
    assert ours["node_type"] == theirs["node_type"] == "CppFunction"
    assert "grad_fn=<RecvRpcBackward>" in theirs["repr"]
    assert ours["repr"] == theirs["repr"]
    for key in ("values", "grads"):
        for mine, torchs in zip(ours[key], theirs[key], strict=True):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(torchs))


@pytest.mark.timeout(200)
def test_gradients_are_copied_or_kept_as_in_torch(runs: dict[str, dict[str, Any]]) -> None:
    expected = {"a_is_b": False, "a_kept": False, "b_kept": False, "alone_kept": True}
    assert runs["RALLYPOINT"]["copies"] == runs["TENSORPIPE"]["copies"] == expected


@pytest.mark.timeout(200)
def test_accumulate_grad_post_hooks_run_once_per_pass_as_in_torch(
    runs: dict[str, dict[str, Any]],
) -> None:
    ours = runs["RALLYPOINT"]["post_hooks"]
    assert ours == runs["TENSORPIPE"]["post_hooks"]
    # once per round with the round's gradient (u's comes in two passes), in order, the
    # removed hook not at all, the leaves' .grad untouched; local autograd's post hooks get
    # the same arguments: ((), (grad,))
    assert ours == [
        ("t1", 0, [8.0]),
        ("t2", 0, [8.0]),
        ("u", 0, [12.0 + 12.0]),
        ("grads", 8.0, 24.0, None, None),
    ]


def test_bad_arguments_say_incompatible_function_arguments_as_torch() -> None:
    theirs: Any = pytest.importorskip("torch.distributed.autograd")
    for ours_call, torch_call in (
        (lambda: dist_autograd.backward(0, None), lambda: theirs.backward(0, None)),  # type: ignore[arg-type]
        (lambda: dist_autograd.backward(None, None), lambda: theirs.backward(None, None)),  # type: ignore[arg-type]
        (lambda: dist_autograd.backward(0, [1]), lambda: theirs.backward(0, [1])),  # type: ignore[list-item]
        (lambda: dist_autograd.get_gradients("x"), lambda: theirs.get_gradients("x")),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError) as torchs:
            torch_call()
        with pytest.raises(TypeError) as ours:
            ours_call()
        prefix = str(torchs.value).split(". ")[0]
        assert prefix.endswith("(): incompatible function arguments"), prefix
        assert str(ours.value).startswith(prefix), (str(ours.value), prefix)
