"""The TENSORPIPE backend: delegates to ``torch.distributed.rpc``'s TensorPipe agent.

It exists so that one program can switch between torch's transport and rallypoint's with
the ``backend=`` argument (tests and the benchmark run both through one API). Semantics
are torch's, including its RRef type and its shutdown behaviour.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.rpc._backend import RpcAgent


def _rpc() -> Any:
    """torch.distributed.rpc, untyped (its stubs export few of the names used here)."""
    return importlib.import_module("torch.distributed.rpc")


def construct_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> Any:
    return _rpc().backend_registry._tensorpipe_construct_rpc_backend_options_handler(
        rpc_timeout, init_method, **kwargs
    )


class TensorPipeAgentAdapter(RpcAgent):
    """Forwards rallypoint's agent interface to ``torch.distributed.rpc``."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    @property
    def rpc_timeout(self) -> float:
        rpc = _rpc()
        return float(rpc.get_rpc_timeout())

    def get_worker_info(self, worker_name: str | int | None = None) -> Any:
        rpc = _rpc()
        return rpc.get_worker_info(worker_name)

    def get_worker_infos(self) -> list[Any]:
        return list(self.agent.get_worker_infos())

    def rpc_async(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> torch.futures.Future[Any]:
        rpc = _rpc()
        future: torch.futures.Future[Any] = rpc.rpc_async(to, func, args, kwargs, timeout)
        return future

    def remote(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> Any:
        rpc = _rpc()
        return rpc.remote(to, func, args, kwargs, timeout)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        rpc = _rpc()
        rpc.shutdown(graceful, timeout)


def start_tensorpipe(
    store: Any, name: str, rank: int, world_size: int | None, options: Any
) -> TensorPipeAgentAdapter:
    """The TENSORPIPE backend's ``init_backend_handler``."""
    from datetime import timedelta

    rpc = _rpc()
    dist_autograd: Any = importlib.import_module("torch.distributed.autograd")
    api, backend_registry = rpc.api, rpc.backend_registry

    if rpc._is_current_rpc_agent_set():
        raise RuntimeError("RPC is already initialized")
    store.set_timeout(timedelta(seconds=options.rpc_timeout))
    dist_autograd._init(rank)
    rpc._set_profiler_node_id(rank)
    agent = backend_registry._tensorpipe_init_backend_handler(
        store, name, rank, world_size, options
    )
    api._init_rpc_states(agent)
    return TensorPipeAgentAdapter(agent)
