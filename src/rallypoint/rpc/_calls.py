"""The public calls: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``.

They mirror ``torch.distributed.rpc`` (same signatures, defaults, errors) and dispatch
to the current agent, whichever backend started it.
"""

from __future__ import annotations

import importlib
import logging
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc.api as _torch_rpc_api

from rallypoint._core.checks import check_int, check_seconds
from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.torch_c import PrefixStore, distributed_rpc
from rallypoint.rpc import _registry
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._group._store import create_store
from rallypoint.rpc._options import RallypointRpcBackendOptions, RpcBackendOptions
from rallypoint.rpc._rref import _rref
from rallypoint.rpc._transport._auth import require_secret_source
from rallypoint.rpc._worker_info import validate_name
from rallypoint.rpc.constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

logger = logging.getLogger("rallypoint.rpc")

_init_lock = fork_safe_lock()
_init_counter = 0


def _is_options(options: object) -> bool:
    if isinstance(options, RpcBackendOptions):
        return True
    torch_options = getattr(distributed_rpc, "RpcBackendOptions", None)
    return torch_options is not None and isinstance(options, torch_options)


def _integral(value: object) -> object:
    """torch accepts any ``numbers.Integral`` (a numpy int) where it wants an int."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool | int):
        return int(value)
    return value


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
    if backend is not None:
        backend = _registry.resolve_backend(backend)
    if rpc_backend_options is not None and not _is_options(rpc_backend_options):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    backend, rpc_backend_options = _choose_backend(backend, rpc_backend_options)
    if rpc_backend_options is None:
        rpc_backend_options = _registry.construct_rpc_backend_options(backend)
    validate_name(name)
    rank = check_int(_integral(rank), "rank")
    world_size = check_int(_integral(world_size), "world_size", minimum=1, allow_none=True)
    with _init_lock:
        if CURRENT_AGENT.peek() is not None:
            raise RuntimeError("RPC is already initialized")
        try:
            _start(backend, name, rank, world_size, rpc_backend_options)
        except BaseException:  # Ctrl-C too: no half-started agent stays current
            CURRENT_AGENT.clear()
            raise


def _choose_backend(backend: Any, options: Any) -> tuple[Any, Any]:
    """``backend``, else the one whose options type ``options`` is, else RALLYPOINT; and
    the options to start it with.

    torch's ``TensorPipeRpcBackendOptions`` without a ``backend`` (or with
    ``BackendType.RALLYPOINT``) mean rallypoint's backend with the same settings: programs
    written for torch build them, and a program whose only change is its import runs on
    rallypoint. ``backend=BackendType.TENSORPIPE`` runs torch's agent.
    """
    rallypoint = _registry.BackendType["RALLYPOINT"]
    if backend is not None and not (backend == rallypoint and _is_tensorpipe_options(options)):
        return backend, options
    if options is None:
        return rallypoint, options
    if _is_tensorpipe_options(options):
        logger.info(
            "init_rpc: TensorPipeRpcBackendOptions without a backend: running on "
            "rallypoint's backend with their num_worker_threads, rpc_timeout, init_method "
            "and device maps (pass backend=BackendType.TENSORPIPE for torch's agent)"
        )
        return rallypoint, RallypointRpcBackendOptions.from_tensorpipe(options)
    for candidate in _registry.BackendType:
        default = _registry.construct_rpc_backend_options(candidate)
        if isinstance(options, type(default)):
            break
    else:
        raise TypeError(f"Could not infer backend for options {options}")
    if candidate.name != "RALLYPOINT":
        logger.warning(
            "RPC was initialized with no explicit backend but with options corresponding "
            "to %s, hence that backend will be used instead of the default "
            "BackendType.RALLYPOINT. To silence this warning pass `backend=%s` explicitly.",
            candidate,
            candidate,
        )
    return candidate, options


def _is_tensorpipe_options(options: Any) -> bool:
    rpc: Any = importlib.import_module("torch.distributed.rpc")
    tensorpipe = getattr(rpc, "TensorPipeRpcBackendOptions", None)
    return tensorpipe is not None and isinstance(options, tensorpipe)


def _start(backend: Any, name: str, rank: int, world_size: int | None, options: Any) -> None:
    global _init_counter

    def check_secret() -> None:  # every worker without one fails now, none waits for a store
        if isinstance(options, RallypointRpcBackendOptions):
            require_secret_source(options)

    timeout = float(options.rpc_timeout)
    shared, rank, _ = create_store(options.init_method, rank, world_size, timeout, check_secret)
    # like torch, each init_rpc of a process uses a fresh key prefix; a failed one does not
    # consume it, so a retry meets the other workers' first attempt
    store = PrefixStore(f"rpc_prefix_{_init_counter}", shared)
    agent = _registry.init_backend(
        backend,
        store=store,
        name=name,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=options,
    )
    _init_counter += 1
    CURRENT_AGENT.set(agent)


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
    # not through rpc_async: torch's rpc_sync future does not join rpc.api._wait_all()
    return CURRENT_AGENT.get().rpc_sync(to, func, *_check_args(args, kwargs), timeout)


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future[Any]:
    """Like :func:`rpc_sync` but returns a ``torch.futures.Future`` at once."""
    agent = CURRENT_AGENT.get()
    future = agent.rpc_async(to, func, *_check_args(args, kwargs), timeout)
    if agent.joins_wait_all:
        _join_wait_all(future)
    return future


def _join_wait_all(future: torch.futures.Future[Any]) -> None:
    """Inside torch's ``with rpc.api._wait_all():`` the future joins the ones it waits
    for on exit, as torch's ``rpc_async`` does."""
    collected = getattr(_torch_rpc_api._thread_local_var, "future_list", None)
    if collected is not None:
        collected.append(future)


def remote(
    to: Any,
    func: Callable[..., Any],
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func`` on ``to`` and return an ``RRef`` to the result, owned by ``to``."""
    agent = CURRENT_AGENT.get()
    if not callable(func):
        raise TypeError("function should be callable.")
    return agent.remote(to, func, *_check_args(args, kwargs), timeout)


# what RRef.rpc_sync() / rpc_async() / remote() proxies call, as torch's RRefProxy
_rref.PROXY_APIS.update(rpc_sync=rpc_sync, rpc_async=rpc_async, remote=remote)


def get_worker_info(worker_name: str | int | None = None) -> Any:
    """``WorkerInfo`` of ``worker_name`` (name or rank), or of this worker."""
    return CURRENT_AGENT.get().get_worker_info(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds."""
    return float(CURRENT_AGENT.get().rpc_timeout)


def _set_rpc_timeout(rpcTimeoutSeconds: float) -> None:  # torch's argument name
    """Set the default timeout of calls made from now on, in seconds (``0``: none).

    torch's private helper (its own tests use it); calls already sent keep theirs.
    """
    seconds = check_seconds(rpcTimeoutSeconds, "rpcTimeoutSeconds", allow_zero=True, numbers=True)
    assert seconds is not None
    CURRENT_AGENT.get().set_rpc_timeout(seconds)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop the agent. Graceful: wait for every worker's outstanding work first.

    With ``timeout=0`` (the default) a graceful shutdown waits as long as the workers it
    waits for are alive, as torch's does (workers may wait here while a master trains for
    hours). It raises ``RpcShutdownError`` naming them as soon as every worker still
    missing is dead (its connection broke) or unreachable (it left a no-op probe
    unanswered for the RPC timeout, at least 5 s). With ``timeout > 0`` it also gives up
    after that many seconds. The local agent is stopped in every case.
    """
    agent = CURRENT_AGENT.get()
    try:
        agent.shutdown(bool(graceful), float(timeout))
    finally:
        CURRENT_AGENT.clear()


def is_available() -> bool:
    """Always true: the rallypoint backend needs only sockets (TENSORPIPE needs torch RPC)."""
    return True
