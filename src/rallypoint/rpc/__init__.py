"""``rallypoint.rpc``: torch.distributed.rpc's API on a fast, authenticated transport.

Same names, signatures and errors as ``torch.distributed.rpc``; change the import::

    from rallypoint import rpc
    rpc.init_rpc("worker0", rank=0, world_size=2)   # env:// (MASTER_ADDR/MASTER_PORT)
    ret = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    rpc.shutdown()

Distributed autograd and ``DistributedOptimizer`` (torch's API, both backends)::

    import rallypoint.rpc.dist_autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", stage, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        rpc.DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.1).step(context_id)

Backends: ``BackendType.RALLYPOINT`` (default: HMAC-authenticated TCP, Unix sockets and
shared memory on one host) and ``BackendType.TENSORPIPE`` (torch's agent). Every connection
must know the job's secret (``RALLYPOINT_RPC_SECRET``, set by ``rallypoint run``).

The tree, one concept per subpackage; imports point down these lines, never up::

    public:          api (shim), nn, optim, dist_autograd's API -> _api, _all_gather
    _api -> _registry -> _agent (BackendType.RALLYPOINT) | _tensorpipe (TENSORPIPE)
    _agent/          the agent: membership, connections, dispatch, codec, calls, peers,
                     liveness; the only part that ties the parts below together
                     (with _torch_names: torch's names for the running agent and RRefs)
    _rref/           RRefs and the table of values a worker owns
    dist_autograd/   distributed autograd: contexts, routes, engine, DDP under it
    _group/          group records and the rendezvous store
    _transport/      connections, frames, wire form, shared memory, CUDA tensors (IPC
                     or staged, and the choice), handshake, readers, spin waits
    shared:          _worker_info, _backend, _current, _options, _device_maps, _errors,
                     _remote_errors, _builtins, _wait_all, functions, constants
                     ->  rallypoint._core
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rallypoint._core.public import set_public_module
from rallypoint.rpc import api as api  # torch's rpc.api path (not in torch's __all__)
from rallypoint.rpc import constants, dist_autograd, functions, nn, optim
from rallypoint.rpc._api import (
    _set_rpc_timeout as _set_rpc_timeout,  # torch's private helper, not in __all__
)
from rallypoint.rpc._api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from rallypoint.rpc._backend import RpcAgent
from rallypoint.rpc._errors import (
    RpcAuthenticationError,
    RpcConnectionError,
    RpcError,
    RpcProtocolError,
    RpcShutdownError,
    RpcTimeoutError,
)
from rallypoint.rpc._options import RallypointRpcBackendOptions, RpcBackendOptions
from rallypoint.rpc._registry import (
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    init_backend,
    register_backend,
)
from rallypoint.rpc._rref._rref import RRef
from rallypoint.rpc._rref._rref import RRef as PyRRef  # torch's rpc.PyRRef: its RRefs' own class
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.api import (
    _get_current_rpc_agent as _get_current_rpc_agent,  # torch's private helpers, as above
)
from rallypoint.rpc.api import (
    _is_current_rpc_agent_set as _is_current_rpc_agent_set,
)
from rallypoint.rpc.constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
)
from rallypoint.rpc.optim import DistributedOptimizer

if TYPE_CHECKING:
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    BackendType: Any

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "BackendType",
    "BackendValue",
    "DistributedOptimizer",
    "PyRRef",
    "RRef",
    "RallypointRpcBackendOptions",
    "RpcAgent",
    "RpcAuthenticationError",
    "RpcBackendOptions",
    "RpcConnectionError",
    "RpcError",
    "RpcProtocolError",
    "RpcShutdownError",
    "RpcTimeoutError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "backend_registered",
    "constants",
    "construct_rpc_backend_options",
    "dist_autograd",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_backend",
    "init_rpc",
    "is_available",
    "nn",
    "optim",
    "register_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]


def is_available() -> bool:
    """Always true: the rallypoint backend needs only sockets (TENSORPIPE needs torch RPC)."""
    return True


# public names say rallypoint.rpc (where users import them), not a private module
set_public_module(__name__, globals(), __all__)


def __getattr__(name: str) -> Any:
    # BackendType is rebuilt by register_backend: resolve it on every access.
    if name == "BackendType":
        from rallypoint.rpc import _registry

        return _registry.BackendType
    if name == "TensorPipeRpcBackendOptions":
        from torch.distributed.rpc import TensorPipeRpcBackendOptions

        return TensorPipeRpcBackendOptions
    raise AttributeError(f"module 'rallypoint.rpc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
