"""torch's private distributed-autograd helpers and ``rpc._set_rpc_timeout``, on both backends.

torch's own tests (``DistAutogradTest``, ``RpcTest``) and debugging tools look into
contexts with ``dist_autograd._current_context()``, ``_retrieve_context``, ``_new_context``,
``_release_context``, ``_get_max_id`` and ``_get_debug_info``, and change the default
timeout with ``rpc._set_rpc_timeout``. One program records what they show (send and
receive functions, known workers, counts, errors) on each backend and the two records are
compared.
"""

from __future__ import annotations

import operator
import os
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "private-helpers-secret"}


def _error(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


class _DebugInfoInBackward(torch.autograd.Function):
    """Records ``_get_debug_info()`` while the backward pass runs."""

    seen: list[dict[str, int]] = []  # one per worker process

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        info = dist_autograd._get_debug_info()
        _DebugInfoInBackward.seen.append({k: int(v) for k, v in info.items()})
        return grad


def _callee_view(context_id: int) -> dict[str, Any]:
    """What the callee's copy of the context shows (runs on w1)."""
    ctx = dist_autograd._retrieve_context(context_id)
    recvs = ctx._recv_functions()
    (send,) = ctx._send_functions().values()  # the reply: torch.add(t1, t2)
    (add, _), *_ = send.next_functions
    return {
        "id": ctx._context_id() == context_id,
        "sends": len(ctx._send_functions()),
        "recvs": len(recvs),
        "recv_names": sorted(node.name() for node in recvs.values()),
        # torch: one RecvRpcBackward node per message, one output per tensor
        "graph": {
            "send": [(node.name(), nr) for node, nr in send.next_functions],
            "add": [(node.name(), nr) for node, nr in add.next_functions],
            "one_recv_node": add.next_functions[0][0] is add.next_functions[1][0],
            "is_the_message_node": add.next_functions[0][0] in list(recvs.values()),
        },
        "known": sorted(ctx._known_worker_ids()),
        "contexts": int(dist_autograd._get_debug_info()["num_autograd_contexts"]),
    }


def _released_on_callee(context_id: int) -> bool:
    """Whether w1 dropped the context within 10 s (releases travel asynchronously)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            dist_autograd._retrieve_context(context_id)
        except RuntimeError:
            return True
        time.sleep(0.02)
    return False


def _inspect_context(out: dict[str, Any]) -> None:
    t1 = torch.ones(2, 2, requires_grad=True)
    t2 = torch.zeros(2, 2, requires_grad=True)
    plain = torch.ones(2, 2)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync("w1", torch.add, args=(t1, t2))
        rpc.rpc_sync("w1", torch.add, args=(plain, plain))  # no tensor requires grad
        ctx = dist_autograd._current_context()
        sends = ctx._send_functions()
        recvs = ctx._recv_functions()
        (send,) = sends.values()
        out["context"] = {
            "current_id": ctx._context_id() == context_id,
            "retrieved_id": dist_autograd._retrieve_context(context_id)._context_id() == context_id,
            "sends": len(sends),
            "send_name": send.name(),
            "send_edges": [(node.name(), nr) for node, nr in send.next_functions],
            "send_variables": [
                node.variable is t
                for (node, _), t in zip(send.next_functions, (t1, t2), strict=True)
            ],
            "recvs": len(recvs),
            "recv_is_grad_fn": next(iter(recvs.values())) == ret.grad_fn,
            "known": sorted(ctx._known_worker_ids()),
            "info": {k: int(v) for k, v in dist_autograd._get_debug_info().items()},
            "callee": rpc.rpc_sync("w1", _callee_view, args=(context_id,)),
        }
        loss = _DebugInfoInBackward.apply(ret).sum()
        dist_autograd.backward(context_id, [loss])
        out["during_backward"] = _DebugInfoInBackward.seen
        out["after_backward"] = {k: int(v) for k, v in dist_autograd._get_debug_info().items()}
    out["after_exit"] = _error(lambda: dist_autograd._retrieve_context(context_id))
    out["released_on_callee"] = rpc.rpc_sync("w1", _released_on_callee, args=(context_id,))
    out["contexts_at_end"] = int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _new_and_release(out: dict[str, Any]) -> None:
    ctx = dist_autograd._new_context()
    context_id = ctx._context_id()
    out["new"] = {
        "is_current": dist_autograd._current_context()._context_id() == context_id,
        "second": _error(dist_autograd._new_context),
        "valid": _error(lambda: dist_autograd._is_valid_context(context_id)),
    }
    dist_autograd._release_context(context_id)
    out["released"] = {
        "current": _error(dist_autograd._current_context)[0],
        "again": _error(lambda: dist_autograd._release_context(context_id)),
        "retrieve": _error(lambda: dist_autograd._retrieve_context(context_id)),
    }
    with dist_autograd.context():  # the thread can open a context again
        pass


def _timeouts(out: dict[str, Any]) -> None:
    rpc._set_rpc_timeout(0.3)
    kind, text = _error(lambda: rpc.rpc_sync("w1", time.sleep, args=(1.5,)))
    out["timeout"] = {
        "get": round(rpc.get_rpc_timeout(), 6),  # torch keeps a float32
        "is_runtime_error": kind in ("RuntimeError", "RpcTimeoutError"),
        "says": "RPC ran for more than set timeout (300 ms)" in text,
    }
    rpc._set_rpc_timeout(30)
    out["timeout"]["fast_call"] = rpc.rpc_sync("w1", operator.add, args=(1, 2))


def _worker(backend: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=30)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] = {"max_id": dist_autograd._get_max_id()}
    try:
        if rank == 0:
            out["no_context"] = _error(dist_autograd._current_context)
            out["unknown"] = _error(lambda: dist_autograd._retrieve_context(12345))
            out["info_at_start"] = {k: int(v) for k, v in dist_autograd._get_debug_info().items()}
            _inspect_context(out)
            _new_and_release(out)
            _timeouts(out)
    finally:
        rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    return {
        backend: runner_for(backend)(_worker, 2, backend, timeout=120, env=ENV)
        for backend in ("RALLYPOINT", "TENSORPIPE")
    }


@pytest.mark.timeout(300)
def test_private_helpers_show_what_torchs_show(runs: dict[str, list[dict[str, Any]]]) -> None:
    ours, theirs = runs["RALLYPOINT"], runs["TENSORPIPE"]
    for mine, torchs in zip(ours, theirs, strict=True):
        assert mine.keys() == torchs.keys()
        for key, value in torchs.items():
            assert mine[key] == value, key
    first = ours[0]
    assert [r["max_id"] for r in ours] == [(1 << 48) - 1, (1 << 48) + (1 << 48) - 1]
    context = first["context"]
    assert context["sends"] == 1 and context["recvs"] == 1 and context["known"] == [1]
    assert context["send_edges"] == [("torch::autograd::AccumulateGrad", 0)] * 2
    assert context["send_variables"] == [True, True] and context["recv_is_grad_fn"]
    assert context["callee"]["sends"] == 1 and context["callee"]["known"] == [0]
    recv_name = "torch::distributed::autograd::RecvRpcBackward"
    assert context["callee"]["graph"] == {
        "send": [("AddBackward0", 0)],
        "add": [(recv_name, 0), (recv_name, 1)],
        "one_recv_node": True,
        "is_the_message_node": True,
    }
    assert first["during_backward"] == [
        {"num_autograd_contexts": 1, "num_current_backward_passes": 1}
    ]
    assert first["after_backward"]["num_current_backward_passes"] == 0
    assert first["released_on_callee"] and first["contexts_at_end"] == 0
    assert first["new"]["second"] == (
        "RuntimeError",
        "Already have an autograd context id for this thread.",
    )
    assert first["timeout"] == {
        "get": 0.3,
        "is_runtime_error": True,
        "says": True,
        "fast_call": 3,
    }


def test_bad_context_ids_raise_torchs_type_error() -> None:
    theirs: Any = pytest.importorskip("torch.distributed.autograd")
    for name in ("_retrieve_context", "_release_context", "_is_valid_context"):
        with pytest.raises(TypeError) as torchs:
            getattr(theirs, name)("x")
        with pytest.raises(TypeError) as ours:
            getattr(dist_autograd, name)("x")
        prefix = str(torchs.value).split(". ")[0]
        assert prefix == f"{name}(): incompatible function arguments", prefix
        assert str(ours.value).startswith(prefix), str(ours.value)


def test_private_helpers_before_init_rpc_say_so() -> None:
    for call in (dist_autograd._current_context, dist_autograd._get_debug_info):
        with pytest.raises(RuntimeError, match=r"rallypoint\.rpc\.init_rpc"):
            call()


@pytest.mark.parametrize(
    ("seconds", "error", "text"),
    [
        (-1, ValueError, "rpcTimeoutSeconds must be >= 0"),
        ("5", TypeError, "rpcTimeoutSeconds must be seconds"),
        (float("nan"), ValueError, "rpcTimeoutSeconds must be >= 0"),
    ],
)
def test_set_rpc_timeout_rejects_bad_values(seconds: Any, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        rpc._set_rpc_timeout(seconds)
