"""Backend registry (torch's semantics) and init_rpc's bad-input errors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint.rpc import _registry
from rallypoint.testing import WorkerError, run_workers


def test_builtin_backends_and_default_options() -> None:
    assert rpc.backend_registered("RALLYPOINT") and rpc.backend_registered("TENSORPIPE")
    assert not rpc.backend_registered("NOPE")
    assert repr(rpc.BackendType.RALLYPOINT) == "BackendType.RALLYPOINT"
    opts = rpc.construct_rpc_backend_options(rpc.BackendType.RALLYPOINT, rpc_timeout=5)
    assert isinstance(opts, rpc.RallypointRpcBackendOptions) and opts.rpc_timeout == 5
    tp = rpc.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, init_method="tcp://127.0.0.1:1", num_worker_threads=4
    )
    assert isinstance(tp, rpc.TensorPipeRpcBackendOptions) and tp.num_worker_threads == 4
    value = rpc.BackendType.RALLYPOINT.value
    assert isinstance(value, rpc.BackendValue)


def test_duplicate_registration_is_refused_with_torchs_message() -> None:
    with pytest.raises(RuntimeError, match=r"^RPC backend RALLYPOINT: already registered$"):
        rpc.register_backend("RALLYPOINT", lambda *a, **k: None, lambda *a, **k: None)
    with pytest.raises(ValueError, match="Python identifier"):
        rpc.register_backend("not valid", lambda *a, **k: None, lambda *a, **k: None)
    with pytest.raises(TypeError, match="two callables"):
        rpc.register_backend("X", None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.construct_rpc_backend_options("RALLYPOINT")


@dataclass(kw_only=True, slots=True)
class _FakeOptions(rpc.RpcBackendOptions):
    tag: str = "fake"


class _FakeAgent(rpc.RpcAgent):
    def __init__(self, name: str, rank: int, store: Any) -> None:
        self.name, self.rank, self.store = name, rank, store
        self.calls: list[Any] = []

    @property
    def rpc_timeout(self) -> float:
        return 1.0

    def get_worker_info(self, worker_name: str | int | None = None) -> Any:
        return rpc.WorkerInfo(self.name, self.rank)

    def get_worker_infos(self) -> list[Any]:
        return [self.get_worker_info()]

    def rpc_async(self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> Any:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(func(*args, **kwargs))
        self.calls.append(to)
        return fut

    def remote(self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float) -> Any:
        raise NotImplementedError

    def shutdown(self, graceful: bool, timeout: float) -> None:
        self.calls.append(("shutdown", graceful))


def _custom_backend(path: str) -> Any:
    agents: list[_FakeAgent] = []

    def construct(rpc_timeout: float, init_method: str, **kwargs: Any) -> _FakeOptions:
        return _FakeOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)

    def init(store: Any, name: str, rank: int, world_size: Any, rpc_backend_options: Any) -> Any:
        agents.append(_FakeAgent(name, rank, store))
        return agents[-1]

    before = set(rpc.BackendType.__members__)
    member = rpc.register_backend("FAKE", construct, init)
    assert member is rpc.BackendType.FAKE and member.name == "FAKE"
    assert set(rpc.BackendType.__members__) == before | {"FAKE"}
    options = _FakeOptions(init_method=f"file://{path}", tag="x")
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options)  # inferred
    assert rpc.rpc_sync("anyone", max, args=(2, 7)) == 7
    assert rpc.get_worker_info().name == "solo"
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        rpc.init_rpc("again", rank=0, world_size=1, rpc_backend_options=options)
    rpc.shutdown(graceful=False)
    assert agents[0].calls == ["anyone", ("shutdown", False)]

    @dataclass(kw_only=True, slots=True)
    class Orphan(rpc.RpcBackendOptions):
        pass

    with pytest.raises(TypeError, match="Could not infer backend for options"):
        rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=Orphan())
    return True


def test_register_custom_backend_and_infer_it_from_options(tmp_path: Any) -> None:
    assert run_workers(_custom_backend, 1, str(tmp_path / "store"), timeout=30) == [True]


def _bad_inputs() -> bool:
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_sync("w", max, args=(1, 2))
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.shutdown()
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("w", backend="RALLYPOINT")
    with pytest.raises(TypeError, match="must be an instance of RpcBackendOptions"):
        rpc.init_rpc("w", rpc_backend_options={"rpc_timeout": 1})
    with pytest.raises(ValueError, match="Worker name must match"):
        rpc.init_rpc("bad name!", rank=0, world_size=1)
    with pytest.raises(ValueError, match="Worker name must match"):
        rpc.init_rpc("", rank=0, world_size=1)
    with pytest.raises(TypeError, match="worker name must be a str"):
        rpc.init_rpc(3, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        rpc.init_rpc("w", rank=0, world_size=0)
    with pytest.raises(TypeError, match="rank must be an int"):
        rpc.init_rpc("w", rank="0", world_size=1)  # type: ignore[arg-type]
    del os.environ["MASTER_ADDR"]
    with pytest.raises(ValueError, match="environment variable MASTER_ADDR expected, but not set"):
        rpc.init_rpc("w", rank=0, world_size=1)
    with pytest.raises(ValueError, match="must look like tcp://host:port"):
        opts = rpc.RallypointRpcBackendOptions(init_method="tcp://nohost")
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=opts)
    with pytest.raises(ValueError, match="rpc_timeout must be >= 0"):
        rpc.RallypointRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(TypeError, match="rpc_timeout must be seconds"):
        rpc.RallypointRpcBackendOptions(rpc_timeout="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_method must start with one of"):
        rpc.RallypointRpcBackendOptions(init_method="http://x")
    with pytest.raises(ValueError, match="secret_file '/nonexistent' does not exist"):
        rpc.RallypointRpcBackendOptions(secret_file="/nonexistent")
    with pytest.raises(ValueError, match="num_worker_threads must be >= 1"):
        rpc.RallypointRpcBackendOptions(num_worker_threads=0)
    for spin in (-1, float("nan"), 2e6, "200", True):
        with pytest.raises(ValueError, match="busy_poll_us must be microseconds from 0"):
            rpc.RallypointRpcBackendOptions(busy_poll_us=spin)  # type: ignore[arg-type]
    from datetime import timedelta

    assert rpc.RallypointRpcBackendOptions(rpc_timeout=timedelta(seconds=2)).rpc_timeout == 2.0
    return True


def test_bad_input_before_init() -> None:
    assert run_workers(_bad_inputs, 1, timeout=30) == [True]


def test_public_surface_mirrors_torch() -> None:
    import torch.distributed.rpc as trpc

    torch_names = {
        "init_rpc",
        "shutdown",
        "rpc_sync",
        "rpc_async",
        "remote",
        "RRef",
        "WorkerInfo",
        "get_worker_info",
        "BackendType",
        "register_backend",
        "backend_registered",
        "construct_rpc_backend_options",
        "init_backend",
        "BackendValue",
        "TensorPipeRpcBackendOptions",
        "functions",
        "is_available",
    }
    assert torch_names <= set(trpc.__all__) | {"functions", "WorkerInfo", "RRef"}
    assert torch_names <= set(rpc.__all__)
    for name in rpc.__all__:
        assert getattr(rpc, name) is not None, name
    assert set(_registry.__all__) <= set(rpc.__all__)
    assert callable(rpc.functions.async_execution)


def _tensorpipe_options_without_backend(path: str) -> dict[str, Any]:
    from rallypoint.rpc._agent._agent import current_rallypoint_agent
    from rallypoint.rpc._backend import CURRENT_AGENT

    out: dict[str, Any] = {}
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=3, rpc_timeout=7, init_method=f"file://{path}-a"
    )
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options)  # no backend
    agent = current_rallypoint_agent()  # RpcError if it is torch's agent
    out["ours"] = (agent.options.num_worker_threads, rpc.get_rpc_timeout())
    out["sum"] = rpc.rpc_sync("solo", max, args=(2, 7))
    rpc.shutdown()
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=27, rpc_timeout=100, init_method=f"file://{path}-c"
    )
    rpc.init_rpc(  # named RALLYPOINT backend, torch's options (torch's test_tensorpipe_set_*)
        "solo",
        backend=rpc.BackendType.RALLYPOINT,
        rank=0,
        world_size=1,
        rpc_backend_options=options,
    )
    agent = current_rallypoint_agent()
    out["named"] = (agent.options.num_worker_threads, rpc.get_rpc_timeout())
    rpc.shutdown()
    open(f"{path}-torch", "w").close()  # from here on, torch's agent runs
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=5, init_method=f"file://{path}-b")
    rpc.init_rpc(
        "solo",
        backend=rpc.BackendType.TENSORPIPE,
        rank=0,
        world_size=1,
        rpc_backend_options=options,
    )
    out["theirs"] = (
        type(CURRENT_AGENT.get()).__name__,
        rpc.get_rpc_timeout(),
        rpc.rpc_sync("solo", max, args=(2, 7)),
    )
    rpc.shutdown()
    return out


@pytest.mark.timeout(60)
def test_torchs_tensorpipe_options_without_a_backend_run_on_rallypoint(tmp_path: Any) -> None:
    env = {"RALLYPOINT_RPC_SECRET": "registry-secret"}
    for attempt in range(2):
        path = str(tmp_path / f"s{attempt}")
        try:
            out = run_workers(_tensorpipe_options_without_backend, 1, path, timeout=25, env=env)[0]
            break
        except WorkerError as exc:
            # torch's TensorPipe agent now and then aborts a process (std::bad_alloc; see
            # run_reference_workers): once it ran, that is torch's failure, not ours
            if not (exc.signalled and os.path.exists(f"{path}-torch")):
                raise
    else:
        pytest.fail("torch's TensorPipe agent killed the worker twice")
    assert out["ours"] == (3, 7.0) and out["sum"] == 7
    assert out["named"] == (27, 100.0)
    assert out["theirs"] == ("TensorPipeAgentAdapter", 5.0, 7)  # named: torch's agent


def test_tensorpipe_options_carry_over_to_rallypoints() -> None:
    theirs = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=5, rpc_timeout=9, init_method="tcp://127.0.0.1:1"
    )
    theirs.set_device_map("w1", {"cpu": "cpu"})
    ours = rpc.RallypointRpcBackendOptions.from_tensorpipe(theirs)
    assert (ours.num_worker_threads, ours.rpc_timeout, ours.init_method) == (
        5,
        9,
        "tcp://127.0.0.1:1",
    )
    assert ours.device_maps == {"w1": {torch.device("cpu"): torch.device("cpu")}}
    assert ours.devices == []


def _init_without_rank(which: str, path: str) -> list[str]:
    """The errors of init_rpc with no rank, for file://, tcp:// and env:// (no RANK set)."""
    import torch.distributed.rpc as torch_rpc

    init = torch_rpc.init_rpc if which == "torch" else rpc.init_rpc
    options = (
        torch_rpc.TensorPipeRpcBackendOptions
        if which == "torch"
        else rpc.RallypointRpcBackendOptions
    )
    os.environ.pop("RANK", None)
    os.environ.pop("MASTER_ADDR", None)  # torch checks RANK first
    errors = []
    for method in (f"file://{path}", "tcp://127.0.0.1:23456", "env://"):
        try:
            init("w", rpc_backend_options=options(init_method=method))  # type: ignore[operator]
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(60)
def test_init_without_rank_says_what_torch_says(tmp_path: Any) -> None:
    env = {"RALLYPOINT_RPC_SECRET": "registry-secret"}
    path = str(tmp_path / "s")
    theirs = run_workers(_init_without_rank, 1, "torch", path, timeout=50, env=env)[0]
    ours = run_workers(_init_without_rank, 1, "ours", path, timeout=50, env=env)[0]
    phrases = [
        "rank parameter missing",
        "rank parameter missing",
        "environment variable RANK expected",
    ]
    assert len(theirs) == len(ours) == 3
    for phrase, torchs, mine in zip(phrases, theirs, ours, strict=True):
        assert phrase in torchs and phrase in mine, (torchs, mine)
    assert "pass rank=" in ours[0] and "set RANK" in ours[2]
