"""The agent interface every backend's ``init_backend_handler`` returns, and the running one.

``RpcAgent`` is the public contract between ``rallypoint.rpc``'s API and a backend.
``Caller`` is the narrower one between the rallypoint agent and its own layers (RRefs,
group membership): they send calls through it and never see the agent itself.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias

import torch

from rallypoint.rpc._current import Current
from rallypoint.rpc._device_maps import DeviceMap, to_device_map

Func: TypeAlias = Callable[..., Any]
Args: TypeAlias = tuple[Any, ...]
Kwargs: TypeAlias = dict[str, Any]
Fut: TypeAlias = torch.futures.Future[Any]


class RpcAgent(abc.ABC):
    """What ``rallypoint.rpc``'s API needs from a backend.

    ``to`` is a worker name, a rank or a ``WorkerInfo``; ``timeout`` is in seconds with
    ``UNSET_RPC_TIMEOUT`` (``-1``) meaning the agent's default and ``0`` no timeout.
    """

    # whether rpc_async's futures join torch's ``rpc.api._wait_all()`` collection here
    # (torch's own agent does that itself)
    joins_wait_all = True

    @abc.abstractmethod
    def get_worker_info(self, worker_name: str | int | None = None) -> Any: ...

    @abc.abstractmethod
    def get_worker_infos(self) -> list[Any]: ...

    @abc.abstractmethod
    def rpc_async(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Fut: ...

    def rpc_sync(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any:
        return self.rpc_async(to, func, args, kwargs, timeout).wait()

    def rpc_all(self, calls: list[tuple[Any, Func, Args]], timeout: float) -> list[Fut]:
        """Make every call ``(to, func, args)`` and wait until all of them completed (with
        a result or an error): their futures, in order. For callers that wait for all the
        replies anyway (``DistributedOptimizer``): an agent may read them on this thread."""
        futures = [self.rpc_async(to, func, args, {}, timeout) for to, func, args in calls]
        for future in futures:
            with contextlib.suppress(Exception):  # the caller reads each future's error
                future.wait()
        return futures

    @abc.abstractmethod
    def remote(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any: ...

    @abc.abstractmethod
    def shutdown(self, graceful: bool, timeout: float) -> None: ...

    @property
    @abc.abstractmethod
    def rpc_timeout(self) -> float: ...

    def set_rpc_timeout(self, seconds: float) -> None:
        """Change the default timeout of the calls made from now on (``0``: none)."""
        raise NotImplementedError(
            f"the {type(self).__name__} backend cannot change its default RPC timeout"
        )

    def get_metrics(self) -> dict[str, str]:
        """torch's agent metrics: ``agent.*`` counts, as strings (torch's keys)."""
        raise NotImplementedError(f"the {type(self).__name__} backend reports no metrics")

    def get_debug_info(self) -> dict[str, str]:
        """torch's ``get_debug_info()``: the metrics (torch adds GIL wait times when GIL
        profiling is on; rallypoint has no GIL profiling)."""
        return self.get_metrics()

    def local_rref(self, value: Any, type_hint: type | None = None) -> Any:
        """``RRef(value)`` for a backend with its own RRef type; ``None``: rallypoint's RRef."""
        return None

    def device_map_to(self, worker_name: str) -> dict[Any, Any]:
        """This worker's device map for calls to ``worker_name`` (empty: none).

        The default reads ``options.device_maps`` (the backend options every built-in
        agent keeps as ``options``); a backend that keeps its maps elsewhere overrides it.
        """
        maps = getattr(getattr(self, "options", None), "device_maps", None) or {}
        return dict(maps.get(worker_name, {}))

    def _get_device_map(self, dst: Any) -> dict[torch.device, torch.device]:
        """torch's private agent method (torch's ``RemoteModule`` and PiPPy call it): the
        device map for calls to ``dst``, a ``WorkerInfo`` (empty: none)."""
        name = getattr(dst, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                "_get_device_map(): incompatible function arguments: expected a WorkerInfo, "
                f"got {type(dst).__name__}"
            )
        return to_device_map(self.device_map_to(name))


CURRENT_AGENT: Current[RpcAgent] = Current()
"""The agent the public calls use (set by ``init_rpc``, and by a backend before it joins)."""


class Caller(Protocol):
    """Sending calls, as the rallypoint agent offers it to RRefs and group membership."""

    def check_open(self) -> None: ...

    def rpc_async(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Fut: ...

    def rpc_sync(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any: ...

    def remote(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any: ...

    def oneway(self, to: str, func: Func, *args: Any, device_map: DeviceMap | None = None) -> bool:
        """Send ``func(*args)`` to ``to`` without waiting for, or expecting, a reply.

        ``device_map`` places its tensors (a gradient's; ``None``: this worker's map for
        ``to``). Returns whether the call went out (``False``: the agent is closed or ``to``
        is unknown or unreachable); it raises only when the message cannot be made (a
        tensor on a device the map has no entry for).
        """
        ...
