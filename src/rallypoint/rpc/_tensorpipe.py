"""The TENSORPIPE backend: delegates to ``torch.distributed.rpc``'s TensorPipe agent.

It exists so that one program can switch between torch's transport and rallypoint's with
the ``backend=`` argument (tests and the benchmark run both through one API). Semantics
are torch's, including its RRef type and its shutdown behaviour.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rallypoint.rpc._backend import CURRENT_AGENT, Args, Func, Fut, Kwargs, RpcAgent

if TYPE_CHECKING:
    from rallypoint._core.store import Store


def _rpc() -> Any:
    """torch.distributed.rpc, untyped (its stubs export few of the names used here)."""
    return importlib.import_module("torch.distributed.rpc")


def construct_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> Any:
    return _rpc().backend_registry._tensorpipe_construct_rpc_backend_options_handler(
        rpc_timeout, init_method, **kwargs
    )


def register_reducer(cls: type, reducer: Any) -> None:
    """Pickle instances of ``cls`` with ``reducer`` in torch's RPC messages (its internal
    pickler's registry), as :func:`rallypoint.rpc._transport._wire.register_reducer` does
    in ours."""
    if _rpc().is_available():
        _rpc().internal._internal_rpc_pickler._register_reducer(cls, reducer)


class TensorPipeAgentAdapter(RpcAgent):
    """Forwards rallypoint's agent interface to ``torch.distributed.rpc``."""

    joins_wait_all = False

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    @property
    def rpc_timeout(self) -> float:
        return float(_rpc().get_rpc_timeout())

    def set_rpc_timeout(self, seconds: float) -> None:
        _rpc()._set_rpc_timeout(seconds)

    def get_worker_info(self, worker_name: str | int | None = None) -> Any:
        return _rpc().get_worker_info(worker_name)

    def get_worker_infos(self) -> list[Any]:
        return list(self.agent.get_worker_infos())

    def rpc_async(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Fut:
        future: Fut = _rpc().rpc_async(to, func, args, kwargs, timeout)
        return future

    def rpc_sync(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any:
        return _rpc().rpc_sync(to, func, args, kwargs, timeout)

    def remote(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any:
        return _rpc().remote(to, func, args, kwargs, timeout)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        _rpc().shutdown(graceful, timeout)

    def get_metrics(self) -> dict[str, str]:
        metrics: dict[str, str] = self.agent.get_metrics()
        return metrics

    def get_debug_info(self) -> dict[str, str]:
        info: dict[str, str] = self.agent.get_debug_info()
        return info

    def local_rref(self, value: Any, type_hint: type | None = None) -> Any:
        """Under this backend a local RRef is torch's own."""
        return _rpc().RRef(value, type_hint)

    def device_map_to(self, worker_name: str) -> dict[Any, Any]:
        return dict(self.agent._get_device_map(self.agent.get_worker_info(worker_name)))


def start_tensorpipe(
    store: Store, name: str, rank: int, world_size: int | None, options: Any
) -> TensorPipeAgentAdapter:
    """The TENSORPIPE backend's ``init_backend_handler``."""
    from rallypoint._core.torch_c import as_torch_store

    rpc = _rpc()
    dist_autograd: Any = importlib.import_module("torch.distributed.autograd")
    if rpc._is_current_rpc_agent_set():
        raise RuntimeError("RPC is already initialized")
    store.set_timeout(timedelta(seconds=options.rpc_timeout))
    dist_autograd._init(rank)
    rpc._set_profiler_node_id(rank)
    # peers may call us (and make us create RRefs) as soon as torch's agent serves,
    # before init_rpc returns: be this process's agent from the start
    adapter = TensorPipeAgentAdapter(None)
    CURRENT_AGENT.set(adapter)
    agent = rpc.backend_registry._tensorpipe_init_backend_handler(
        as_torch_store(store), name, rank, world_size, options
    )
    rpc.api._init_rpc_states(agent)
    adapter.agent = agent
    return adapter
