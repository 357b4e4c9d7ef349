"""The public calls: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``.

They mirror ``torch.distributed.rpc`` (same signatures, defaults, errors) and dispatch
to the current agent, whichever backend started it.
"""

from __future__ import annotations

import importlib
import logging
import numbers
import threading
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.rpc import _registry
from rallypoint.rpc._backend import RpcAgent
from rallypoint.rpc._constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from rallypoint.rpc._errors import NOT_INITIALIZED, RpcError
from rallypoint.rpc._groups import create_store, validate_name
from rallypoint.rpc._options import RpcBackendOptions

logger = logging.getLogger("rallypoint.rpc")

_current: RpcAgent | None = None
_init_lock = threading.Lock()
_init_counter = 0


def current_agent() -> RpcAgent:
    """The running agent; ``RuntimeError`` if ``init_rpc`` has not been called."""
    agent = _current
    if agent is None:
        raise RpcError(NOT_INITIALIZED)
    return agent


def set_current(agent: RpcAgent | None) -> None:
    """Make ``agent`` the one the public calls use (backends call this before joining)."""
    global _current
    _current = agent


def _is_options(options: object) -> bool:
    if isinstance(options, RpcBackendOptions):
        return True
    try:
        from torch._C._distributed_rpc import RpcBackendOptions as TorchOptions
    except ImportError:  # pragma: no cover - torch built without RPC
        return False
    return isinstance(options, TorchOptions)


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: Any = None,
) -> None:
    """Start this worker's RPC agent (``torch.distributed.rpc.init_rpc``'s signature).

    ``backend`` defaults to ``BackendType.RALLYPOINT``, or is inferred from the type of
    ``rpc_backend_options``. With ``world_size`` the group is static (start-up waits for
    every rank); with ``world_size=None`` workers join and leave at runtime.
    """
    global _current, _init_counter
    if backend is not None:
        backend = _registry.resolve_backend(backend)
    if rpc_backend_options is not None and not _is_options(rpc_backend_options):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if backend is None and rpc_backend_options is not None:
        for candidate in _registry.BackendType:
            default = _registry.construct_rpc_backend_options(candidate)
            if isinstance(rpc_backend_options, type(default)):
                backend = candidate
                break
        else:
            raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
        if backend.name != "RALLYPOINT":
            logger.warning(
                "RPC was initialized with no explicit backend but with options corresponding "
                "to %s, hence that backend will be used instead of the default "
                "BackendType.RALLYPOINT. To silence this warning pass `backend=%s` explicitly.",
                backend,
                backend,
            )
    if backend is None:
        backend = _registry.BackendType["RALLYPOINT"]
    if rpc_backend_options is None:
        rpc_backend_options = _registry.construct_rpc_backend_options(backend)
    validate_name(name)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
            raise TypeError(f"world_size must be an int or None, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(
                f"world_size must be >= 1 (or None for a dynamic group), got {world_size}"
            )
    with _init_lock:
        if _current is not None:
            raise RuntimeError("RPC is already initialized")
        try:
            _start(backend, name, int(rank), world_size, rpc_backend_options)
        except BaseException:
            _current = None
            raise


def _start(backend: Any, name: str, rank: int, world_size: int | None, options: Any) -> None:
    global _current, _init_counter
    timeout = float(options.rpc_timeout)
    store, rank, _ = create_store(options.init_method, rank, world_size, timeout)
    dist: Any = importlib.import_module("torch.distributed")
    # like torch, each init_rpc of a process uses a fresh key prefix; a failed one does not
    # consume it, so a retry meets the other workers' first attempt
    store = dist.PrefixStore(f"rpc_prefix_{_init_counter}", store)
    agent = _registry.init_backend(
        backend,
        store=store,
        name=name,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=options,
    )
    _init_counter += 1
    _current = agent


def _check_args(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args is None:
        args = ()
    elif not isinstance(args, tuple | list):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    return tuple(args), kwargs


def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result."""
    agent = current_agent()
    call_args, call_kwargs = _check_args(args, kwargs)
    return agent.rpc_async(to, func, call_args, call_kwargs, timeout).wait()


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future[Any]:
    """Like :func:`rpc_sync` but returns a ``torch.futures.Future`` at once."""
    agent = current_agent()
    call_args, call_kwargs = _check_args(args, kwargs)
    return agent.rpc_async(to, func, call_args, call_kwargs, timeout)


def remote(
    to: Any,
    func: Callable[..., Any],
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func`` on ``to`` and return an ``RRef`` to the result, owned by ``to``."""
    agent = current_agent()
    if not callable(func):
        raise TypeError("function should be callable.")
    call_args, call_kwargs = _check_args(args, kwargs)
    return agent.remote(to, func, call_args, call_kwargs, timeout)


def get_worker_info(worker_name: str | int | None = None) -> Any:
    """``WorkerInfo`` of ``worker_name`` (name or rank), or of this worker."""
    return current_agent().get_worker_info(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds."""
    return float(current_agent().rpc_timeout)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop the agent. Graceful: wait for every worker's outstanding work first.

    Never hangs: gives up after ``timeout`` seconds (``0``: the RPC timeout) and raises
    ``RpcShutdownError`` naming the workers that did not arrive; a worker known to have
    died ends the wait at once. The local agent is stopped in every case.
    """
    global _current
    agent = current_agent()
    try:
        agent.shutdown(bool(graceful), float(timeout))
    finally:
        _current = None
