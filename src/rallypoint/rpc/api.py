"""torch's ``torch.distributed.rpc.api`` path, for programs that reach the calls through it.

``rpc.api.rpc_sync`` and the other calls in torch's ``api.__all__`` are
``rallypoint.rpc``'s. Two of torch's private helpers that programs use are here too:
``_wait_all()``, torch's own context manager (``rpc_async`` futures join its list, see
:mod:`rallypoint.rpc._calls`), ``_get_current_rpc_agent()``, the running agent
(``get_worker_info``, ``get_worker_infos``), ``_is_current_rpc_agent_set()`` and the
``_require_initialized`` decorator. So are torch's all-gather and barrier
(``_all_gather``, ``_barrier``, ``_wait_all_workers``: :mod:`rallypoint.rpc._all_gather`);
rallypoint's ``shutdown`` does not run on them, so patching them does not change it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from torch.distributed.rpc.api import _thread_local_var, _wait_all

from rallypoint.rpc._all_gather import all_gather as _all_gather
from rallypoint.rpc._all_gather import barrier as _barrier
from rallypoint.rpc._all_gather import wait_all_workers as _wait_all_workers
from rallypoint.rpc._backend import CURRENT_AGENT, RpcAgent
from rallypoint.rpc._calls import get_worker_info, remote, rpc_async, rpc_sync, shutdown
from rallypoint.rpc._rref._rref import RRef
from rallypoint.rpc._torch_names import answer_agent_check_too
from rallypoint.rpc._wait_all import wrap_torch_wait_all

__all__ = ["RRef", "get_worker_info", "remote", "rpc_async", "rpc_sync", "shutdown"]
__all__ += ["_get_current_rpc_agent", "_thread_local_var", "_wait_all"]
__all__ += ["_all_gather", "_barrier", "_wait_all_workers"]
__all__ += ["_is_current_rpc_agent_set", "_require_initialized"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _get_current_rpc_agent() -> RpcAgent:
    """The running agent; torch's "not initialized" error if there is none."""
    return CURRENT_AGENT.get()


def _is_current_rpc_agent_set() -> bool:
    """Whether an agent runs in this process (``init_rpc`` returned, ``shutdown`` not)."""
    return CURRENT_AGENT.peek() is not None


# programs that ask torch's C++ module at call time see rallypoint's agent too
answer_agent_check_too()
wrap_torch_wait_all()  # returns at a failed rallypoint call, as at a failed torch one


def _require_initialized(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """torch's decorator: ``func`` raises torch's "not initialized" ``RuntimeError`` while
    no agent runs (programs decorate their own RPC helpers with it)."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        CURRENT_AGENT.get()
        return func(*args, **kwargs)

    return wrapper
