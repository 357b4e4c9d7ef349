"""The agent interface every backend's ``init_backend_handler`` returns."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch


class RpcAgent(abc.ABC):
    """What ``rallypoint.rpc``'s API needs from a backend.

    ``to`` is a worker name, a rank or a ``WorkerInfo``; ``timeout`` is in seconds with
    ``UNSET_RPC_TIMEOUT`` (``-1``) meaning the agent's default and ``0`` no timeout.
    """

    @abc.abstractmethod
    def get_worker_info(self, worker_name: str | int | None = None) -> Any: ...

    @abc.abstractmethod
    def get_worker_infos(self) -> list[Any]: ...

    @abc.abstractmethod
    def rpc_async(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> torch.futures.Future[Any]: ...

    @abc.abstractmethod
    def remote(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> Any: ...

    @abc.abstractmethod
    def shutdown(self, graceful: bool, timeout: float) -> None: ...

    @property
    @abc.abstractmethod
    def rpc_timeout(self) -> float: ...
