"""torch's builtin operators as call targets (``rpc_sync(to, torch.add, args=(1, 2))``):
the same results and the same errors as torch's RPC, which matches the arguments to a
TorchScript overload on the caller (so ``torch.add(1, 2)`` gives the int 3 there, not
``tensor(3)`` as a local call does) and raises at the call when none matches. Both
backends run the same program in the test and every outcome is compared."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc._builtins import BuiltinOp, resolve
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "builtins-secret"}
T = torch.tensor([1.0, -2.0])

CASES: list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
    ("add ints", torch.add, (1, 2), {}),
    ("add floats", torch.add, (1.5, 2), {}),
    ("add bool", torch.add, (True, 2), {}),
    ("add tensor number", torch.add, (T, 3), {}),
    ("add alpha", torch.add, (T, T), {"alpha": 2}),
    ("add out", torch.add, (T, 1), {"out": torch.zeros(2)}),
    ("add str", torch.add, ("a", 2), {}),
    ("add lists", torch.add, ([1], [2]), {}),
    ("add nothing", torch.add, (), {}),
    ("add shapes differ", torch.add, (T, torch.ones(3)), {}),
    ("mul ints", torch.mul, (2, 3), {}),
    ("sub float int", torch.sub, (2.5, 1), {}),
    ("div ints", torch.div, (7, 2), {}),
    ("div mode", torch.div, (T, 2), {"rounding_mode": "floor"}),
    ("neg int", torch.neg, (3,), {}),
    ("sqrt", math.sqrt, (4.0,), {}),
    ("factorial", math.factorial, (5,), {}),
    ("factorial str", math.factorial, ("x",), {}),  # one TorchScript schema: its own error
    ("ones int", torch.ones, (2,), {}),
    ("ones list", torch.ones, ([2],), {}),
    ("zeros dtype", torch.zeros, ([2],), {"dtype": torch.int64}),
    ("max", torch.max, (T,), {}),
    ("split", torch.split, (torch.arange(4), 2), {}),
    ("cat", torch.cat, ([T, T],), {}),
    ("relu", torch.relu, (T,), {}),
    ("cdist str", torch.cdist, ("a", "b"), {}),  # no TorchScript schema: no error listed
    ("matmul", torch.matmul, (torch.ones(2, 2), T), {}),
    ("not a builtin", torch.nn.functional.relu, (T,), {}),
]


def _outcome(call: Callable[[], Any]) -> tuple[str, ...]:
    try:
        fut = call()
    except Exception as exc:
        return ("at the call", type(exc).__name__, str(exc))
    try:
        value = fut.wait()
    except Exception as exc:  # the callee's error
        return ("at wait", type(exc).__name__, str(exc))
    return ("value", type(value).__name__, repr(value))


def _program(backend: str) -> dict[str, Any] | None:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=30)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] | None = None
    if rank == 0:
        out = {}
        for name, func, args, kwargs in CASES:
            call = functools.partial(rpc.rpc_async, "w1", func, args=args, kwargs=kwargs)
            out[name] = _outcome(call)
        value = rpc.rpc_sync("w1", torch.mul, args=(4, 5))
        out["rpc_sync"] = ("value", type(value).__name__, repr(value))
        value = rpc.remote("w1", torch.add, args=(1, 2)).to_here()
        out["remote"] = ("value", type(value).__name__, repr(value))
        out["remote str"] = _outcome(lambda: rpc.remote("w1", torch.add, args=("a", 2)))
    rpc.shutdown()
    return out


@pytest.mark.timeout(180)
def test_builtin_operators_give_torchs_results_and_errors() -> None:
    torchs = runner_for("TENSORPIPE")(_program, 2, "TENSORPIPE", timeout=120, env=ENV)[0]
    ours = runner_for("RALLYPOINT")(_program, 2, "RALLYPOINT", timeout=120, env=ENV)[0]
    # the cases test something: torch's int result, torch's refusals at the call
    assert torchs["add ints"] == ("value", "int", "3")
    assert torchs["ones int"][0] == "at the call"
    assert torchs["add shapes differ"][0] == "at wait"
    for case in torchs:
        if torchs[case][0] == "at wait":
            # an error on the callee: torch's text (the type's name, the operator's message,
            # then C++ frames) is in ours, which names the worker and has the Python trace
            # after the type's name, as for functions
            where, kind, text = torchs[case]
            assert ours[case][:2] == (where, kind), case
            assert text.splitlines()[0].removeprefix(f"{kind}: ") in ours[case][2], case
            assert ours[case][2].startswith(f"{kind}: On WorkerInfo(id=1, name=w1):"), case
        else:
            assert ours[case] == torchs[case], case


def _multiple_returns(backend: str) -> tuple[str, ...] | None:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2)
    out = None
    if rank == 0:
        out = _outcome(lambda: rpc.rpc_async("w1", torch.max, args=(T, 0)))
    rpc.shutdown()
    return out


@pytest.mark.timeout(120)
def test_an_operator_with_two_results_returns_them() -> None:
    # torch's RPC fails an internal assert on an overload with two results (torch.max
    # with a dim: "Return value of a builtin operator ... should be a single IValue");
    # rallypoint returns them as a tuple, as torch.ops.aten.max.dim does
    torchs = runner_for("TENSORPIPE")(_multiple_returns, 2, "TENSORPIPE", timeout=100, env=ENV)
    assert torchs[0][:2] == ("at wait", "RuntimeError")
    assert "should be a single IValue" in torchs[0][2]
    ours = runner_for("RALLYPOINT")(_multiple_returns, 2, "RALLYPOINT", timeout=100, env=ENV)
    assert ours[0] == ("value", "tuple", repr(tuple(torch.max(T, 0))))


def test_resolve_leaves_other_functions_alone() -> None:
    def mine(x: int) -> int:
        return x

    assert resolve(mine, (1,), {}) is mine
    op = resolve(torch.add, (1, 2), {})
    assert isinstance(op, BuiltinOp) and op.__name__ == "aten::add.int"
    assert op(1, 2) == 3 and type(op(1, 2)) is int
    assert resolve(torch.add, (T, T), {}).__name__ == "aten::add.Tensor"
