"""The RPC contract: behaviour every rallypoint RPC backend must show.

``run_rpc_contract(backend)`` starts three forked workers with ``backend`` (a
``BackendType`` name such as ``"RALLYPOINT"`` or ``"TENSORPIPE"``) and runs every check of
torch.distributed.rpc's public API that both backends share; it returns the checks that
ran, per rank, and raises (naming the check) on the first failure. ``run_rpc_pattern``
runs one pattern of real RPC programs (:mod:`rallypoint.testing._rpc._patterns`); every
backend must return the same results.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rallypoint._core.envvars import RPC_SECRET
from rallypoint._core.torch_c import Future, distributed_rpc
from rallypoint.rpc.functions import async_execution
from rallypoint.testing._rpc._patterns import PATTERNS, run_rpc_pattern
from rallypoint.testing._workers import run_reference_workers, run_workers

__all__ = ["PATTERNS", "run_rpc_contract", "run_rpc_pattern"]


def _add(a: Any, b: Any) -> Any:
    return a + b


def _kw(a: int, *, b: int = 0) -> int:
    return a * 10 + b


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _whoami() -> str:
    from rallypoint import rpc

    return str(rpc.get_worker_info().name)


def _call_back(to: str) -> str:
    from rallypoint import rpc

    return str(rpc.rpc_sync(to, _whoami))


def _fetch(rref: Any) -> Any:
    return rref.to_here()


def _confirmed(rref: Any) -> bool:
    return bool(rref.confirmed_by_owner())


def _self_from_rref(method: Callable[..., Any]) -> Callable[..., Any]:
    """What torchrl's ``accept_remote_rref_invocation`` does: a method called on the owner
    with an RRef in place of ``self`` (``rpc_sync(rref.owner(), Class.method, args=(rref,
    ...))``) runs on its value. It tells RRefs apart by torch's C++ class, at call time."""

    @functools.wraps(method)
    def unwrap(self: Any, *args: Any) -> Any:
        if isinstance(self, distributed_rpc.PyRRef):
            self = self.local_value()
        return method(self, *args)

    return unwrap


class _Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def get(self) -> int:
        return self.value

    @_self_from_rref
    def bump(self, k: int) -> int:
        return self.add(k)


@torch.jit.script
def _scripted_affine(x: torch.Tensor, scale: float, shift: float = 0.0) -> torch.Tensor:
    return x * scale + shift


@torch.jit.script
def _scripted_raise(message: str) -> torch.Tensor:
    raise ValueError(message)


@async_execution
def _async_add_chained(to: str, x: torch.Tensor, y: int, z: int) -> Any:
    from rallypoint import rpc

    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


def _checks(rank: int, backend: str) -> list[str]:
    from rallypoint import rpc

    done: list[str] = []
    if rank != 0:
        return done
    me = "worker0"

    def check(name: str, condition: bool) -> None:
        if not condition:
            raise AssertionError(f"{backend}: contract check {name!r} failed")
        done.append(name)

    check("get_worker_info self", rpc.get_worker_info().name == me)
    check("get_worker_info peer id", rpc.get_worker_info("worker2").id == 2)
    check("rpc_sync scalars", rpc.rpc_sync("worker1", _add, args=(2, 3)) == 5)
    check("rpc_sync kwargs", rpc.rpc_sync("worker1", _kw, args=(1,), kwargs={"b": 2}) == 12)
    out = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2, 3), 1))
    check("rpc_sync builtin tensor op", torch.equal(out, torch.full((2, 3), 2.0)))
    view = torch.arange(12.0).reshape(3, 4).t()
    check("non-contiguous tensor", torch.equal(rpc.rpc_sync("worker1", _add, args=(view, 0)), view))
    big = torch.randn(1 << 18)
    check("1 MiB tensor", torch.equal(rpc.rpc_sync("worker2", _add, args=(big, 0)), big))
    fut = rpc.rpc_async("worker1", _add, args=(torch.tensor([1, 2]), 1))
    check("rpc_async is torch Future", isinstance(fut, Future))
    check("rpc_async value", fut.wait().tolist() == [2, 3])
    chained = rpc.rpc_async("worker1", _add, args=(1, 1)).then(lambda f: f.wait() * 10)
    check("future then", chained.wait() == 20)
    many = [rpc.rpc_async(f"worker{1 + i % 2}", _add, args=(i, 1)) for i in range(200)]
    check("200 concurrent rpc_async", [f.wait() for f in many] == list(range(1, 201)))
    try:
        rpc.rpc_sync("worker1", _raise_value_error, args=("contract-boom",))
        check("remote exception raises", False)
    except ValueError as exc:
        check("remote exception type", "contract-boom" in str(exc))
        check("remote traceback", "_raise_value_error" in str(exc))
    try:
        rpc.rpc_sync("worker1", _sleep, args=(3.0,), timeout=0.3)
        check("timeout raises", False)
    except RuntimeError as exc:
        check("timeout error", "timeout" in str(exc).lower() or "timed out" in str(exc).lower())
    check("nested call back to caller", rpc.rpc_sync("worker1", _call_back, args=(me,)) == me)
    ret = rpc.rpc_sync("worker1", _async_add_chained, args=("worker2", torch.ones(2), 1, 1))
    check("async_execution", torch.equal(ret, torch.full((2,), 3.0)))
    _rref_checks(check, me)
    _script_checks(check)
    tensor_rref = rpc.remote("worker2", torch.add, args=(torch.ones(3), 2))
    check("remote builtin to_here", torch.equal(tensor_rref.to_here(), torch.full((3,), 3.0)))
    bad = rpc.remote("worker1", _raise_value_error, args=("rref-boom",))
    try:
        bad.to_here()
        check("failed remote raises on to_here", False)
    except ValueError as exc:
        check("failed remote error", "rref-boom" in str(exc))
    try:
        bad._get_type()
        check("failed remote _get_type raises", False)
    except ValueError as exc:
        check("failed remote _get_type error", "rref-boom" in str(exc))
    return done


def _rref_checks(check: Callable[[str, bool], None], me: str) -> None:
    """RRefs: owners, proxies, forks to a third worker, confirmations, local RRefs."""
    from rallypoint import rpc

    rref = rpc.remote("worker1", _Counter, args=(5,))
    check("rref owner", rref.owner().name == "worker1" and rref.owner_name() == "worker1")
    check("rref is_owner false", not rref.is_owner())
    check("rref rpc_sync proxy", rref.rpc_sync().add(2) == 7)
    check("rref rpc_async proxy", rref.rpc_async().add(3).wait() == 10)
    check("rref remote proxy", rref.remote().get().to_here() == 10)
    typed = rref._get_type(blocking=False)  # torch's private helper, which its proxies use
    check("rref _get_type", typed.wait() is _Counter)
    check("rref _get_type cached", rref._get_type(blocking=False) is typed)
    try:
        rref.remote().no_such_method()
        check("remote proxy of a missing method raises at once", False)
    except AttributeError as exc:
        check("remote proxy missing method", "has no attribute 'no_such_method'" in str(exc))
    check("rref to_here copy", rref.to_here().value == 10)
    check("rref isinstance RRef, PyRRef", isinstance(rref, rpc.RRef | rpc.PyRRef))
    torch_class = distributed_rpc.PyRRef
    check("rref isinstance torch's PyRRef", isinstance(rref, torch_class))
    check("rref as self on owner", rpc.rpc_sync(rref.owner(), _Counter.bump, (rref, 0)) == 10)
    check("rref fork to third worker", rpc.rpc_sync("worker2", _fetch, args=(rref,)).value == 10)
    # torch runs a call once the RRefs forked into its arguments are confirmed by the owner
    check("forked rref confirmed in call", rpc.rpc_sync("worker2", _confirmed, args=(rref,)))
    check(
        "forked rref confirmed in remote",
        rpc.remote("worker2", _confirmed, args=(rref,)).to_here(),
    )
    local = rpc.RRef(torch.arange(3))
    check("local rref is owner", local.is_owner() and local.owner_name() == me)
    check("local rref value", torch.equal(local.local_value(), torch.arange(3)))
    check("local rref _get_type", local._get_type() is torch.Tensor)
    check(
        "local rref fork",
        torch.equal(rpc.rpc_sync("worker2", _fetch, args=(local,)), torch.arange(3)),
    )


def _script_checks(check: Callable[[str, bool], None]) -> None:
    """``@torch.jit.script`` functions as call targets (torch sends them by name)."""
    from rallypoint import rpc

    x = torch.arange(3.0)
    scripted = rpc.rpc_sync("worker1", _scripted_affine, args=(x, 2.0), kwargs={"shift": 1.0})
    check("torchscript rpc_sync", torch.equal(scripted, x * 2 + 1))
    scripted = rpc.rpc_async("worker2", _scripted_affine, args=(x, 3.0)).wait()
    check("torchscript rpc_async", torch.equal(scripted, x * 3))
    scripted = rpc.remote("worker1", _scripted_affine, args=(x, 0.5)).to_here()
    check("torchscript remote", torch.equal(scripted, x * 0.5))
    try:
        rpc.rpc_sync("worker2", _scripted_raise, args=("script-boom",))
        check("torchscript error raises", False)
    except Exception as exc:
        check("torchscript error", "script-boom" in str(exc))


def _worker(backend: str) -> list[str]:
    from rallypoint import rpc

    rank = int(os.environ["RANK"])
    options = rpc.construct_rpc_backend_options(rpc.BackendType[backend], rpc_timeout=30)
    rpc.init_rpc(
        f"worker{rank}",
        backend=rpc.BackendType[backend],
        rank=rank,
        world_size=3,
        rpc_backend_options=options,
    )
    try:
        done = _checks(rank, backend)
    finally:
        rpc.shutdown()
    return done


def run_rpc_contract(
    backend: str, *, timeout: float = 90.0, env: Mapping[str, str] | None = None
) -> list[list[str]]:
    """Run the contract against ``backend`` in three fresh worker processes."""
    extra = {RPC_SECRET: "contract-secret", **(env or {})}
    run = run_reference_workers if backend == "TENSORPIPE" else run_workers
    return run(_worker, 3, backend, timeout=timeout, env=extra)
