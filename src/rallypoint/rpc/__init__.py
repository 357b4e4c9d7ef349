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

    public:          api (shim), nn, optim, dist_autograd's API -> _calls, _all_gather
    _calls -> _registry -> _agent (BackendType.RALLYPOINT) | _tensorpipe (TENSORPIPE)
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

from torch.distributed.rpc import TensorPipeRpcBackendOptions as TensorPipeRpcBackendOptions

from rallypoint._core.public import set_public_module
from rallypoint.rpc import api as api
from rallypoint.rpc import constants as constants
from rallypoint.rpc import dist_autograd as dist_autograd
from rallypoint.rpc import functions as functions
from rallypoint.rpc import nn as nn
from rallypoint.rpc import optim as optim
from rallypoint.rpc._backend import RpcAgent as RpcAgent
from rallypoint.rpc._calls import _set_rpc_timeout as _set_rpc_timeout
from rallypoint.rpc._calls import get_rpc_timeout as get_rpc_timeout
from rallypoint.rpc._calls import get_worker_info as get_worker_info
from rallypoint.rpc._calls import init_rpc as init_rpc
from rallypoint.rpc._calls import is_available as is_available
from rallypoint.rpc._calls import remote as remote
from rallypoint.rpc._calls import rpc_async as rpc_async
from rallypoint.rpc._calls import rpc_sync as rpc_sync
from rallypoint.rpc._calls import shutdown as shutdown
from rallypoint.rpc._errors import RpcAuthenticationError as RpcAuthenticationError
from rallypoint.rpc._errors import RpcConnectionError as RpcConnectionError
from rallypoint.rpc._errors import RpcError as RpcError
from rallypoint.rpc._errors import RpcProtocolError as RpcProtocolError
from rallypoint.rpc._errors import RpcShutdownError as RpcShutdownError
from rallypoint.rpc._errors import RpcTimeoutError as RpcTimeoutError
from rallypoint.rpc._options import RallypointRpcBackendOptions as RallypointRpcBackendOptions
from rallypoint.rpc._options import RpcBackendOptions as RpcBackendOptions
from rallypoint.rpc._registry import BackendType as BackendType
from rallypoint.rpc._registry import BackendValue as BackendValue
from rallypoint.rpc._registry import backend_registered as backend_registered
from rallypoint.rpc._registry import (
    construct_rpc_backend_options as construct_rpc_backend_options,
)
from rallypoint.rpc._registry import init_backend as init_backend
from rallypoint.rpc._registry import register_backend as register_backend
from rallypoint.rpc._rref._rref import PyRRef as PyRRef
from rallypoint.rpc._rref._rref import RRef as RRef
from rallypoint.rpc._worker_info import WorkerInfo as WorkerInfo
from rallypoint.rpc.api import _get_current_rpc_agent as _get_current_rpc_agent
from rallypoint.rpc.api import _is_current_rpc_agent_set as _is_current_rpc_agent_set
from rallypoint.rpc.constants import DEFAULT_INIT_METHOD as DEFAULT_INIT_METHOD
from rallypoint.rpc.constants import DEFAULT_RPC_TIMEOUT_SEC as DEFAULT_RPC_TIMEOUT_SEC
from rallypoint.rpc.constants import DEFAULT_SHUTDOWN_TIMEOUT as DEFAULT_SHUTDOWN_TIMEOUT
from rallypoint.rpc.constants import UNSET_RPC_TIMEOUT as UNSET_RPC_TIMEOUT
from rallypoint.rpc.optim import DistributedOptimizer as DistributedOptimizer

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
    "api",
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

set_public_module(__name__, globals(), __all__)  # the one place: __module__ is this face
del set_public_module
