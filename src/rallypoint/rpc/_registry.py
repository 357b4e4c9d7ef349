"""The RPC backend registry, with ``torch.distributed.rpc.backend_registry``'s semantics.

``BackendType`` is an enum rebuilt every time a backend is registered (as in torch); read
it as ``rallypoint.rpc.BackendType`` (resolved on access, never a stale copy) or keep the
member :func:`register_backend` returns. ``RALLYPOINT`` (the default: our transport) and
``TENSORPIPE`` (torch's TensorPipe agent) are registered on import. A backend is a pair of
handlers, :func:`register_backend` says which.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from rallypoint.rpc._options import RallypointRpcBackendOptions
from rallypoint.rpc.constants import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = [
    "BackendValue",
    "backend_registered",
    "construct_rpc_backend_options",
    "init_backend",
    "register_backend",
]


class BackendValue(NamedTuple):
    construct_rpc_backend_options_handler: Callable[..., Any]
    init_backend_handler: Callable[..., Any]


_BACKEND_DOC = """An enum of the registered RPC backends.

rallypoint registers ``BackendType.RALLYPOINT`` (the default) and
``BackendType.TENSORPIPE``; add more with :func:`register_backend`.
"""


def _repr(self: enum.Enum) -> str:
    return "BackendType." + self.name


def _make_enum(members: dict[str, BackendValue]) -> Any:
    new = enum.Enum("BackendType", members)  # type: ignore[misc]
    new.__repr__ = _repr  # type: ignore[method-assign,assignment]
    new.__doc__ = _BACKEND_DOC
    new.__module__ = "rallypoint.rpc"
    return new


BackendType: Any = _make_enum({})


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` has been registered with :func:`register_backend`."""
    return backend_name in BackendType.__members__


def register_backend(
    backend_name: str,
    construct_rpc_backend_options_handler: Callable[..., Any],
    init_backend_handler: Callable[..., Any],
) -> Any:
    """Register a backend; returns its new ``BackendType`` member.

    ``construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)`` returns the
    backend's options object; ``init_backend_handler(store, name, rank, world_size,
    rpc_backend_options)`` returns an agent implementing :class:`rallypoint.rpc.RpcAgent`.

    Raises ``RuntimeError("RPC backend {name}: already registered")`` on duplicates.
    """
    global BackendType
    if not isinstance(backend_name, str) or not backend_name.isidentifier():
        raise ValueError(
            f"backend name must be a Python identifier such as 'MY_BACKEND', got {backend_name!r}"
        )
    if not callable(construct_rpc_backend_options_handler) or not callable(init_backend_handler):
        raise TypeError(
            "register_backend needs two callables: an options handler and an init handler"
        )
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    members = {
        backend_name: BackendValue(construct_rpc_backend_options_handler, init_backend_handler)
    }
    members.update({m.name: m.value for m in BackendType})
    BackendType = _make_enum(members)
    face = sys.modules.get("rallypoint.rpc")  # its re-export shows the new member too
    if face is not None:
        vars(face)["BackendType"] = BackendType
    return BackendType[backend_name]


def resolve_backend(backend: object) -> Any:
    """The current ``BackendType`` member for ``backend`` (also accepts stale members)."""
    if isinstance(backend, BackendType):
        return backend
    if (
        isinstance(backend, enum.Enum)
        and type(backend).__name__ == "BackendType"
        and backend_registered(backend.name)
        and type(backend).__module__ == "rallypoint.rpc"
    ):
        return BackendType[backend.name]
    raise TypeError("Argument backend must be a member of BackendType")


def construct_rpc_backend_options(
    backend: Any,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> Any:
    """Build ``backend``'s options object through its registered handler."""
    member = resolve_backend(backend)
    return member.value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Start ``backend``'s agent through its registered handler."""
    member = resolve_backend(backend)
    return member.value.init_backend_handler(*args, **kwargs)


def _rallypoint_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> Any:
    return RallypointRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _rallypoint_init(
    store: Store, name: str, rank: int, world_size: int | None, rpc_backend_options: Any
) -> Any:
    from rallypoint.rpc._agent._agent import start_agent

    return start_agent(store, name, rank, world_size, rpc_backend_options)


def _tensorpipe_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> Any:
    from rallypoint.rpc._tensorpipe import construct_options

    return construct_options(rpc_timeout, init_method, **kwargs)


def _tensorpipe_init(
    store: Store, name: str, rank: int, world_size: int | None, rpc_backend_options: Any
) -> Any:
    from rallypoint.rpc._tensorpipe import start_tensorpipe

    return start_tensorpipe(store, name, rank, world_size, rpc_backend_options)


register_backend("TENSORPIPE", _tensorpipe_options, _tensorpipe_init)
register_backend("RALLYPOINT", _rallypoint_options, _rallypoint_init)
