"""RPC behaviour found by running torch's own RpcTest against rallypoint, compared with torch.

Each case runs on both backends in the same test: a function the callee does not have
fails with torch's ``RuntimeError`` ("Default RPC pickler does not serialize function
code"), and a duplicate worker name fails every worker with a message that says the name
"is not unique" (torch's wording, which torch's test matches). ``WorkerInfo`` checks its
name as torch's constructor does (``RuntimeError``, torch's message). ``init_rpc`` succeeds
when a peer finished its own ``init_rpc`` and left with ``shutdown(graceful=False)`` before
this worker opened its first connection to it. ``RRef.backward`` (owner and user RRefs,
local and distributed) and an ``RRef`` made before ``init_rpc`` behave as torch's. A
remote error's message has its escapes undone (a ``\\n`` is a new line) and the callee
prints the error on its stderr, as torch's. Pickling an ``RRef`` outside RPC, an unknown
destination and a user RRef's ``to_here`` after ``shutdown`` fail with torch's words;
``str()`` of an RRef and ``local_value()`` on a user show torch's ids and text.
Every ``except`` clause that catches torch's remote exception catches ours (torch turns
all but ``ValueError``/``TypeError`` into ``RuntimeError``), ``rpc_async`` futures join
torch's ``rpc.api._wait_all()``, and an ``@async_execution`` function that returns no
future fails with torch's ``RuntimeError``. The calls also work through torch's
``rpc.api`` path, and ``_get_current_rpc_agent()`` lists the workers.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "torch-suite-secret"}
BACKENDS = ("RALLYPOINT", "TENSORPIPE")


def only_on_the_caller() -> torch.Tensor:
    return torch.ones(1)


def _init(backend: str, name: str, world_size: int) -> None:
    kind = rpc.BackendType[backend]
    options = rpc.construct_rpc_backend_options(kind, rpc_timeout=20)
    rank = int(os.environ["RANK"])
    rpc.init_rpc(name, backend=kind, rank=rank, world_size=world_size, rpc_backend_options=options)


def _missing_function(backend: str) -> tuple[str, str] | None:
    rank = int(os.environ["RANK"])
    if rank == 1:
        del globals()["only_on_the_caller"]  # before init_rpc: forgotten before rank 0 calls
    _init(backend, f"w{rank}", 2)
    out = None
    try:
        if rank == 0:
            try:
                rpc.rpc_sync("w1", only_on_the_caller)
            except Exception as exc:  # the type is what is compared
                out = (type(exc).__name__, str(exc))
    finally:
        rpc.shutdown()
    return out


@pytest.mark.timeout(120)
def test_a_function_missing_on_the_callee_is_torchs_runtime_error() -> None:
    for backend in BACKENDS:
        seen = runner_for(backend)(_missing_function, 2, backend, timeout=60, env=ENV)[0]
        assert seen is not None, backend
        kind, message = seen
        assert kind == "RuntimeError", (backend, seen)
        assert "RPC pickler does not serialize function code" in " ".join(message.split())
        assert "only_on_the_caller" in message


def _duplicate(backend: str) -> tuple[str, str]:
    rank = int(os.environ["RANK"])
    try:
        _init(backend, f"w{rank % 2}", 3)  # ranks 0 and 2 are both "w0"
    except RuntimeError as exc:  # torch: RuntimeError; rallypoint: RpcError, a RuntimeError
        return ("RuntimeError", str(exc))
    rpc.shutdown()
    return ("no error", "")


@pytest.mark.timeout(120)
def test_a_duplicate_name_fails_every_worker_saying_it_is_not_unique() -> None:
    for backend in BACKENDS:
        seen: list[Any] = runner_for(backend)(_duplicate, 3, backend, timeout=60, env=ENV)
        for kind, message in seen:
            assert kind == "RuntimeError", (backend, seen)
            assert "w0" in message and "is not unique" in message, (backend, message)


def test_worker_info_checks_the_name_as_torchs() -> None:
    theirs: Any = pytest.importorskip("torch.distributed.rpc")
    for bad in ("abc*", " ", "", "a" * 128):
        with pytest.raises(RuntimeError) as torchs:
            theirs.WorkerInfo(bad, 0)
        with pytest.raises(RuntimeError) as ours:
            rpc.WorkerInfo(bad, 0)
        prefix = str(torchs.value).split(", but got")[0]
        assert str(ours.value).startswith(prefix), (str(ours.value), prefix)
    good = "worker-0:a_b"
    assert repr(rpc.WorkerInfo(good, 3)) == repr(theirs.WorkerInfo(good, 3))


def _one_leaves_right_after_init(backend: str, gone: str) -> str:
    rank = int(os.environ["RANK"])
    if rank == 0 and backend == "RALLYPOINT":
        # make torch's race certain: rank 0 opens its warm-up connection to w2 only after
        # w2 has left (torch's RpcTest.test_local_shutdown loses it now and then)
        from rallypoint.rpc._agent._connections import Connections

        real = Connections._open

        def late(self: Connections, name: str) -> Any:
            deadline = time.monotonic() + 30
            while name == "w2" and not os.path.exists(gone) and time.monotonic() < deadline:
                time.sleep(0.01)
            return real(self, name)

        Connections._open = late  # type: ignore[method-assign]
    _init(backend, f"w{rank}", 3)
    if rank == 2:
        rpc.shutdown(graceful=False)
        open(gone, "w").close()
        return "left"
    done = f"{gone}.done"
    if rank == 1:  # stay until rank 0 has its answer
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)
        rpc.shutdown(graceful=False)
        return "served"
    result = rpc.rpc_sync("w1", torch.add, args=(torch.ones(1), 1))
    open(done, "w").close()
    rpc.shutdown(graceful=False)
    return f"{result.item():.0f}"


@pytest.mark.timeout(150)
def test_init_rpc_succeeds_when_a_peer_already_left_with_an_ungraceful_shutdown(
    tmp_path: Any,
) -> None:
    for backend in BACKENDS:
        gone = str(tmp_path / f"{backend}-gone")
        seen = runner_for(backend)(
            _one_leaves_right_after_init, 3, backend, gone, timeout=60, env=ENV
        )
        assert seen == ["2", "served", "left"], (backend, seen)


def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def _first_line(call: Any) -> str:
    try:
        call()
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if "RRef" in line or "context" in line]
        return lines[0] if lines else str(exc).splitlines()[0]
    return "no error"


def _rref_backward(backend: str) -> dict[str, Any] | None:
    from rallypoint.rpc import dist_autograd

    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    out: dict[str, Any] | None = None
    try:
        if rank == 0:
            t = torch.arange(4.0, requires_grad=True)
            rpc.RRef((t * t).sum()).backward()  # owner, local: into .grad
            assert t.grad is not None
            out = {"local": t.grad.tolist()}
            with dist_autograd.context() as cid:  # owner, distributed
                rpc.RRef(rpc.rpc_sync("w1", torch.mul, args=(t, 3)).sum()).backward(cid)
                out["owner"] = dist_autograd.get_gradients(cid)[t].tolist()
            with dist_autograd.context() as cid:  # a user RRef: its owner runs the pass
                rref = rpc.remote("w1", _sum, args=(t * t,))
                rref.backward(cid, retain_graph=True)
                rref.backward(cid)
                out["user"] = dist_autograd.get_gradients(cid)[t].tolist()
                out["no ctx"] = _first_line(lambda: rref.backward())
                out["not a tensor"] = _first_line(
                    lambda: rpc.remote("w1", str, args=("x",)).backward(cid)
                )
            out["unknown ctx"] = _first_line(lambda: rpc.RRef(t.sum()).backward(12345))
    finally:
        rpc.shutdown()
    return out


@pytest.mark.timeout(150)
def test_rref_backward_as_torchs() -> None:
    runs = {b: runner_for(b)(_rref_backward, 2, b, timeout=60, env=ENV)[0] for b in BACKENDS}
    ours, torchs = runs["RALLYPOINT"], runs["TENSORPIPE"]
    assert ours == torchs  # the owner's error text too, as it is (fairscale found it wrapped)
    assert "RRef should contain a tensor for .backward()" in torchs["not a tensor"]
    assert ours["local"] == [0.0, 2.0, 4.0, 6.0]
    assert ours["owner"] == [3.0] * 4
    assert ours["user"] == [0.0, 4.0, 8.0, 12.0]  # two passes
    assert "User RRefs require 'dist_autograd_ctx_id'" in ours["no ctx"]
    assert "RRef should contain a tensor for .backward()" in ours["not a tensor"]
    assert "Could not find autograd context with id: 12345" in ours["unknown ctx"]


def test_an_rref_before_init_rpc_says_the_agent_is_not_set_as_torchs() -> None:
    theirs: Any = pytest.importorskip("torch.distributed.rpc")
    with pytest.raises(RuntimeError) as torchs:
        theirs.RRef(1)
    with pytest.raises(RuntimeError) as ours:
        rpc.RRef(1)
    prefix = "Current RPC agent is not set! Did you initialize the RPC framework"
    assert str(torchs.value).startswith(prefix) and str(ours.value).startswith(prefix)


MULTILINE = "\nFirst line of error \n next line of error \n last line of error"


def _raise_multiline() -> None:
    raise ValueError(MULTILINE)


def _remote_error(backend: str) -> tuple[str, str]:
    import contextlib
    import io

    rank = int(os.environ["RANK"])
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        _init(backend, f"w{rank}", 2)
        message = ""
        try:
            if rank == 0:
                try:
                    rpc.rpc_sync("w1", _raise_multiline)
                except ValueError as exc:
                    message = str(exc)
        finally:
            rpc.shutdown()
    return message, stderr.getvalue()


@pytest.mark.timeout(150)
def test_a_remote_error_is_unescaped_and_printed_on_the_callee_as_torchs() -> None:
    for backend in BACKENDS:
        (message, _), (_, callee_stderr) = runner_for(backend)(_remote_error, 2, backend, env=ENV)
        # torch's RpcTest.test_py_raise_in_user_func_escaped_str and ..._in_user_func
        assert MULTILINE in message, (backend, message)
        assert message == message.encode("utf-8").decode("unicode_escape"), backend
        assert "First line of error" in callee_stderr, (backend, callee_stderr)


def _rref_misuse(backend: str) -> dict[str, str] | None:
    import pickle

    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    out: dict[str, str] = {}
    rref = rpc.remote(f"w{1 - rank}", torch.add, args=(torch.ones(1), 1))
    rref.to_here()
    for name, call in (
        ("pickle", lambda: pickle.dumps(rpc.RRef(35))),
        ("unknown name", lambda: rpc.rpc_sync("nobody", torch.add, args=(1, 1))),
    ):
        try:
            call()
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
    rpc.shutdown()
    try:
        rref.to_here()
        out["after shutdown"] = "no error"
    except RuntimeError as exc:
        out["after shutdown"] = str(exc)
    return out if rank == 0 else None


@pytest.mark.timeout(150)
def test_rref_and_destination_misuse_say_what_torch_says() -> None:
    for backend in BACKENDS:
        seen = runner_for(backend)(_rref_misuse, 2, backend, timeout=60, env=ENV)[0]
        assert "Can not pickle rref in python pickler" in seen["pickle"], (backend, seen)
        assert "could not find destination" in seen["unknown name"], (backend, seen)
        assert "Cannot call to_here() on it after deletion." in seen["after shutdown"], seen


def _str_of(rref: Any) -> str:
    return str(rref)


def _rref_texts(backend: str) -> dict[str, str] | None:
    """What ``str()`` of owner, created and forked RRefs and ``local_value()`` on a user
    say (torch's RRef and fork ids share one count per worker, from 0)."""
    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 3)
    out: dict[str, str] = {}
    if rank == 0:
        out["owner"] = str(rpc.RRef(35))
        rref = rpc.remote("w1", torch.add, args=(torch.ones(1), 1))
        out["user"] = str(rref)
        out["forked"] = rpc.rpc_sync("w2", _str_of, args=(rref,))  # a fork made on w0
        out["on owner"] = rpc.rpc_sync("w1", _str_of, args=(rref,))
        try:
            rref.local_value()
        except RuntimeError as exc:
            out["local_value"] = str(exc)
    rpc.shutdown()
    return out if rank == 0 else None


@pytest.mark.timeout(150)
def test_rref_texts_and_ids_are_torchs() -> None:
    theirs = runner_for("TENSORPIPE")(_rref_texts, 3, "TENSORPIPE", timeout=60, env=ENV)[0]
    ours = runner_for("RALLYPOINT")(_rref_texts, 3, "RALLYPOINT", timeout=60, env=ENV)[0]
    assert theirs["owner"] == "OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))"
    hint = ", or use to_here() to copy the value to this worker"  # ours says how, after torch's
    assert ours.pop("local_value") == theirs.pop("local_value") + hint
    assert ours == theirs


class AppError(Exception):
    """A user's own exception type, raised by a remote function."""


_KINDS = {"KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError, "AppError": AppError}
_KINDS.update({"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError})
_CLAUSES = (RuntimeError, ValueError, TypeError)


def _raise_kind(kind: str) -> None:
    raise _KINDS[kind]("remote boom")


@rpc.functions.async_execution
def _returns_no_future() -> int:
    return 1


def _remote_errors(backend: str) -> dict[str, Any] | None:
    import torch.distributed.rpc.api as torch_rpc_api

    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    out: dict[str, Any] = {}
    if rank == 0:
        calls = {
            "sync": lambda k: rpc.rpc_sync("w1", _raise_kind, args=(k,)),
            "async": lambda k: rpc.rpc_async("w1", _raise_kind, args=(k,)).wait(),
            "remote": lambda k: rpc.remote("w1", _raise_kind, args=(k,)).to_here(),
        }
        for kind, cls in _KINDS.items():
            for mode, call in calls.items():
                try:
                    call(kind)
                    out[f"{kind} {mode}"] = "no error"
                except Exception as exc:  # which of torch's except clauses catch it
                    caught = {c.__name__ for c in (*_CLAUSES, cls) if isinstance(exc, c)}
                    # up to the trace (KeyError's text is one line: its repr)
                    first_line = str(exc).splitlines()[0].split("Traceback")[0]
                    out[f"{kind} {mode}"] = (sorted(caught), "remote boom" in str(exc), first_line)
        with torch_rpc_api._wait_all():
            future = rpc.rpc_async("w1", torch.add, args=(torch.ones(2), 1))
            rpc.rpc_sync("w1", torch.add, args=(torch.ones(2), 1))  # does not join
            collected = list(torch_rpc_api._thread_local_var.future_list)
        out["wait_all"] = (len(collected), collected[0] is future, future.done())
        try:
            rpc.rpc_sync("w1", _returns_no_future)
        except Exception as exc:
            out["no future"] = (type(exc).__name__, str(exc))
    rpc.shutdown()
    return out if rank == 0 else None


@pytest.mark.timeout(150)
def test_remote_errors_are_caught_by_torchs_except_clauses_and_by_their_own_type() -> None:
    seen = {b: runner_for(b)(_remote_errors, 2, b, timeout=60, env=ENV)[0] for b in BACKENDS}
    ours, torchs = seen["RALLYPOINT"], seen["TENSORPIPE"]
    for case in _cases(torchs):
        caught, has_text, first_line = ours[case]
        torch_caught, _, torch_first_line = torchs[case]
        kind = case.split()[0]
        # every clause that catches torch's exception catches ours, and so does its own type
        assert set(torch_caught) <= set(caught) and kind in caught, (case, caught, torch_caught)
        assert has_text, case
        # torch's text: "KeyError: 'On WorkerInfo(...)" from a future, no name from to_here
        assert first_line == torch_first_line, (case, first_line, torch_first_line)
    assert "RuntimeError" in ours["KeyError sync"][0]  # torch raises RuntimeError for it
    assert ours["wait_all"] == torchs["wait_all"] == (1, True, True)
    # torch's words for an @async_execution function that returned no future, its type too
    for backend, (kind, text) in ((b, s["no future"]) for b, s in seen.items()):
        assert kind == "RuntimeError", (backend, kind)
        assert "must return a torch.futures.Future object" in text, (backend, text)


def _cases(results: dict[str, Any]) -> list[str]:
    return [case for case in results if case not in ("wait_all", "no future")]


def _through_api_module(backend: str) -> dict[str, Any] | None:
    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    infos = rpc._get_current_rpc_agent().get_worker_infos()
    out = {
        "me": rpc.api.get_worker_info() == rpc.get_worker_info(),
        "infos": sorted((info.name, info.id) for info in infos),
        "sum": rpc.api.rpc_sync(f"w{1 - rank}", torch.add, args=(1, 2)),
    }
    rpc.shutdown()
    return out


@pytest.mark.timeout(120)
def test_the_calls_through_torchs_api_module_path() -> None:
    # torch's RpcTest.test_worker_info_pickle and test_get_worker_infos reach them there
    for backend in BACKENDS:
        got = runner_for(backend)(_through_api_module, 2, backend, timeout=60, env=ENV)
        assert got == [{"me": True, "infos": [("w0", 0), ("w1", 1)], "sum": 3}] * 2, backend
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.api._get_current_rpc_agent()


def _observe(is_set: Any, require: Any) -> list[Any]:
    """What a program sees of an agent through ``_is_current_rpc_agent_set`` and a helper
    decorated with ``_require_initialized`` (PyG's distributed module uses both)."""

    @require
    def helper(x: int) -> int:
        return x + 1

    try:
        called: Any = helper(1)
    except RuntimeError as exc:
        called = ("RuntimeError", str(exc).startswith("RPC has not been initialized. Call "))
    return [is_set(), called, helper.__name__]


def _pyg_style_check() -> bool:
    """PyG's ``rpc_is_initialized``: torch's C++ function, imported when called."""
    from torch._C._distributed_rpc import _is_current_rpc_agent_set

    return bool(_is_current_rpc_agent_set())


def _agent_set(backend: str) -> dict[str, list[Any]]:
    import torch.distributed.rpc as torch_rpc
    import torch.distributed.rpc.api as torch_api

    ours = (rpc.api._is_current_rpc_agent_set, rpc.api._require_initialized)
    theirs = (torch_api._is_current_rpc_agent_set, torch_api._require_initialized)
    seen: dict[str, list[Any]] = {"ours": _observe(*ours), "torch": _observe(*theirs)}
    seen["c"] = [_pyg_style_check()]
    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    seen["ours"] += [*_observe(*ours), rpc._is_current_rpc_agent_set()]
    seen["torch"] += [*_observe(*theirs), torch_api._is_current_rpc_agent_set()]
    seen["c"] += [_pyg_style_check(), torch_rpc._is_current_rpc_agent_set()]
    rpc.shutdown()
    seen["ours"] += _observe(*ours)
    seen["torch"] += _observe(*theirs)
    seen["c"] += [_pyg_style_check()]
    return seen


@pytest.mark.timeout(120)
def test_is_current_rpc_agent_set_and_require_initialized_behave_as_torchs() -> None:
    before = [False, ("RuntimeError", True), "helper"]
    running = [True, 2, "helper", True]
    for backend in BACKENDS:
        got = runner_for(backend)(_agent_set, 2, backend, timeout=60, env=ENV)
        for seen in got:
            assert seen["ours"] == before + running + before, backend
            if backend == "TENSORPIPE":  # torch's own functions see torch's own agent
                assert seen["torch"] == seen["ours"]
                assert seen["c"] == [False, True, True, False]
            else:  # code that asks torch's C++ module at call time sees ours too (PyG);
                # torch's own modules keep torch's answer (no torch agent runs)
                assert seen["c"] == [False, True, False, False]
                assert seen["torch"] == before + before + [False] + before


def _pyrref_class() -> Any:
    """torch's C++ RRef class as torchrl reads it: the module attribute, at call time."""
    return torch._C._distributed_rpc.PyRRef


def _pyrref_checks(backend: str) -> dict[str, Any]:
    import torch.distributed.rpc as torch_rpc

    original = torch_rpc.PyRRef  # torch's modules bound it at import
    out: dict[str, Any] = {"before": _pyrref_class() is original}
    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    rref = rpc.remote("w1", torch.add, args=(torch.ones(2), 1))
    local = rpc.RRef(3)
    now = _pyrref_class()
    out["isinstance"] = [
        isinstance(r, cls) for r in (rref, local) for cls in (now, rpc.RRef, rpc.PyRRef)
    ]
    out["not others"] = [isinstance(x, (now, rpc.RRef)) for x in (1, "s", None)]
    out["issubclass"] = issubclass(type(rref), now) and issubclass(type(rref), rpc.RRef)
    out["exact torch type"] = type(rref) is now  # torchrl's own test asserts this on torch
    # anything else goes to torch's class: making one needs torch's agent
    out["deserialize"] = now._deserialize is original._deserialize
    try:
        now(1)
        out["make"] = "made"
    except RuntimeError as exc:
        out["make"] = "agent is not set" in str(exc) if backend == "RALLYPOINT" else "made?"
    if backend == "TENSORPIPE":
        out["make"] = isinstance(now(1), original)
    out["torch modules keep theirs"] = torch_rpc.PyRRef is original
    del rref, local
    rpc.shutdown()
    out["after"] = _pyrref_class() is original
    return out


@pytest.mark.timeout(120)
def test_isinstance_of_torchs_rref_classes_holds_for_both_backends_rrefs() -> None:
    """torchrl recognises an RRef by ``isinstance(x, torch._C._distributed_rpc.PyRRef)``
    (``accept_remote_rref_invocation``): true of rallypoint's RRefs while its agent runs,
    and torch's class itself whenever torch's agent runs."""
    for backend in BACKENDS:
        got = runner_for(backend)(_pyrref_checks, 2, backend, timeout=60, env=ENV)
        for seen in got:
            assert seen["before"] and seen["after"] and seen["torch modules keep theirs"]
            assert seen["isinstance"] == [True] * 6, backend
            assert seen["not others"] == [False] * 3
            assert seen["issubclass"] and seen["deserialize"] and seen["make"] is True
            assert seen["exact torch type"] is (backend == "TENSORPIPE")


def _boom() -> None:
    raise ValueError("boom")


class _Booms:
    def boom(self) -> None:
        raise ValueError("boom method")


def _bad_loss() -> torch.Tensor:
    """A loss whose backward fails on its owner."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in backward")

    return Fails.apply(torch.ones(2, requires_grad=True)).sum()  # type: ignore[no-any-return]


def _error_line(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc).splitlines()[0]
    return "no error", ""


def _owner_side_errors(backend: str) -> list[tuple[str, str]] | None:
    from rallypoint.rpc import dist_autograd

    rank = int(os.environ["RANK"])
    _init(backend, f"w{rank}", 2)
    out = None
    if rank == 0:
        booms = rpc.remote("w0", _Booms)
        failed = rpc.remote("w0", _boom)
        loss = rpc.remote("w1", _bad_loss)
        with dist_autograd.context() as context_id:
            out = [
                _error_line(lambda: failed.to_here()),  # the caller owns it
                _error_line(lambda: failed.local_value()),
                _error_line(lambda: booms.remote().boom().to_here()),
                _error_line(lambda: rpc.remote("w1", _boom).to_here()),
                _error_line(lambda: loss.backward(context_id)),  # fails on its owner
            ]
    rpc.shutdown()
    return out


@pytest.mark.timeout(120)
def test_errors_raised_on_an_rrefs_owner_read_as_torchs() -> None:
    """fairscale found both: a failed ``remote`` on the caller itself raised the bare
    exception from ``to_here()``, and a failed ``RRef.backward`` on another owner came
    wrapped in the remote-error text; torch raises the owner's text as it is."""
    got = {b: runner_for(b)(_owner_side_errors, 2, b, timeout=60, env=ENV)[0] for b in BACKENDS}
    assert got["RALLYPOINT"] == got["TENSORPIPE"]
    assert got["TENSORPIPE"][0] == ("ValueError", "On WorkerInfo(id=0, name=w0):")
    assert got["TENSORPIPE"][4] == ("RuntimeError", "Error on Node 1: boom in backward")
