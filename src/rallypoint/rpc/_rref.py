"""Remote references: ``RRef`` and the owner's reference counts.

Lifetime model (documented in docs/rpc.md):

- The *owner* keeps each value in a table with a count of live ``RRef`` objects
  anywhere in the job. ``remote()`` counts the creator's RRef; ``RRef(value)`` counts the
  local one.
- Sending an RRef to another worker *forks* it: the sender pins its RRef object until
  the receiver has registered its own count at the owner (``_rref_incref``), then the
  receiver tells the sender to unpin. So the count never drops to zero while a fork is
  in flight.
- When an RRef object is garbage-collected its worker queues a decrement; the agent
  sends decrements to owners in batches. At zero the owner drops the value.
- Shutdown drops every table; RRefs used after shutdown raise.
"""

from __future__ import annotations

import functools
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from rallypoint.rpc import _wire
from rallypoint.rpc._constants import UNSET_RPC_TIMEOUT
from rallypoint.rpc.functions import async_execution, is_async_execution

if TYPE_CHECKING:
    from rallypoint.rpc._agent import RallypointAgent
    from rallypoint.rpc._groups import WorkerInfo

T = TypeVar("T")
RRefId = tuple[str, int, int]


class _Entry:
    __slots__ = ("count", "future")

    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.count = 0


class OwnerTable:
    """Values owned by this worker, with the number of live RRefs to each."""

    def __init__(self) -> None:
        self._entries: dict[RRefId, _Entry] = {}
        self._lock = threading.RLock()

    def entry(self, rref_id: RRefId) -> _Entry:
        with self._lock:
            found = self._entries.get(rref_id)
            if found is None:
                found = self._entries[rref_id] = _Entry()
            return found

    def incref(self, rref_id: RRefId, n: int = 1) -> _Entry:
        with self._lock:
            found = self.entry(rref_id)
            found.count += n
            return found

    def decref(self, rref_id: RRefId) -> None:
        with self._lock:
            found = self._entries.get(rref_id)
            if found is None:
                return
            found.count -= 1
            if found.count <= 0:
                del self._entries[rref_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rref_id: object) -> bool:
        return rref_id in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class RRef(Generic[T]):
    """A reference to a value owned by one worker (``torch.distributed.rpc.RRef``'s API).

    ``RRef(value)`` makes a local RRef owned by this worker; ``remote()`` returns one owned
    by the callee.
    """

    __slots__ = ("__weakref__", "_agent", "_confirmed", "_id", "_owner")

    def __new__(cls, *args: Any, **kwargs: Any) -> RRef[Any]:
        if args or kwargs:
            from rallypoint.rpc import _api
            from rallypoint.rpc._tensorpipe import TensorPipeAgentAdapter

            if isinstance(_api._current, TensorPipeAgentAdapter):
                # under the TENSORPIPE backend a local RRef must be torch's own
                import torch.distributed.rpc as torch_rpc

                rref: RRef[Any] = torch_rpc.RRef(*args, **kwargs)  # type: ignore[assignment]
                return rref
        return super().__new__(cls)

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        from rallypoint.rpc._agent import current_rallypoint_agent

        agent = current_rallypoint_agent()
        rref_id = agent.new_rref_id()
        entry = agent.rrefs.incref(rref_id)
        entry.future.set_result(value)
        self._setup(agent, agent.info, rref_id, None)

    @classmethod
    def _make(
        cls,
        agent: RallypointAgent,
        owner: WorkerInfo,
        rref_id: RRefId,
        confirmed: torch.futures.Future[Any] | None,
    ) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._setup(agent, owner, rref_id, confirmed)
        return rref

    def _setup(
        self,
        agent: RallypointAgent,
        owner: WorkerInfo,
        rref_id: RRefId,
        confirmed: torch.futures.Future[Any] | None,
    ) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rref_id
        self._confirmed = confirmed
        weakref.finalize(self, agent.release_rref, owner.name, rref_id)

    def owner(self) -> WorkerInfo:
        """``WorkerInfo`` of the worker that owns the value."""
        return self._owner

    def owner_name(self) -> str:
        return self._owner.name

    def is_owner(self) -> bool:
        return self._owner.name == self._agent.info.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has registered this RRef (always true on the owner)."""
        return self._confirmed is None or self._confirmed.done()

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if not self.is_owner():
            raise RuntimeError(
                f"local_value() can only be called on the owner ({self._owner.name}); "
                "use to_here() to copy the value to this worker"
            )
        value: T = self._agent.rrefs.entry(self._id).future.wait()
        return value

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """Copy the value from the owner (the value itself on the owner)."""
        self._agent.check_open()
        if self.is_owner():
            return self.local_value()
        fut = self._agent.rpc_async(self._owner, _rref_fetch, (self._id,), {}, timeout)
        value: T = fut.wait()
        return value

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_sync().method(*a)`` runs ``method`` on the owner's value."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy returning futures: ``rref.rpc_async().method(*a).wait()``."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy returning RRefs owned by this RRef's owner."""
        return _Proxy(self, "remote", timeout)

    def _get_future(self) -> torch.futures.Future[Any]:
        if self._confirmed is not None:
            return self._confirmed
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self._owner.name}, id={self._id})"


class _Proxy:
    __slots__ = ("_api", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], api: str, timeout: float) -> None:
        self._rref = rref
        self._api = api
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return functools.partial(_proxy_call, self._rref, self._api, name, self._timeout)


def _proxy_call(
    rref: RRef[Any], api: str, name: str, timeout: float, *args: Any, **kwargs: Any
) -> Any:
    agent = rref._agent
    call_args = (rref, name, args, kwargs)
    if api == "remote":
        return agent.remote(rref.owner(), _rref_invoke, call_args, {}, timeout)
    fut = agent.rpc_async(rref.owner(), _rref_invoke, call_args, {}, timeout)
    return fut.wait() if api == "sync" else fut


def reduce_rref(agent: RallypointAgent, rref: RRef[Any]) -> _wire.ReduceValue:
    """Pickle hook: fork ``rref`` to another worker (pins it until the fork registers)."""
    fork_id = agent.pin(rref)
    owner = rref.owner()
    return (_rref_unpickle, (owner.name, owner.id, rref._id, fork_id, agent.info.name))


def _rref_unpickle(
    owner_name: str, owner_id: int, rref_id: RRefId, fork_id: int, sender: str
) -> RRef[Any]:
    from rallypoint.rpc._agent import current_rallypoint_agent
    from rallypoint.rpc._groups import WorkerInfo

    agent = current_rallypoint_agent()
    owner = WorkerInfo(owner_name, owner_id)
    if owner_name == agent.info.name:
        agent.rrefs.incref(rref_id)
        agent.unpin_at(sender, fork_id)
        return RRef._make(agent, owner, rref_id, None)
    confirmed = agent.rpc_async(owner, _rref_incref, (rref_id,), {}, 0)
    confirmed.add_done_callback(lambda _: agent.unpin_at(sender, fork_id))
    return RRef._make(agent, owner, rref_id, confirmed)


# ---- functions that run on the owner ---------------------------------------------------
def _owner_agent() -> RallypointAgent:
    from rallypoint.rpc._agent import current_rallypoint_agent

    return current_rallypoint_agent()


@async_execution
def _rref_create(
    rref_id: RRefId, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    agent = _owner_agent()
    entry = agent.rrefs.incref(rref_id)
    done: torch.futures.Future[Any] = torch.futures.Future()

    def finish(result: torch.futures.Future[Any]) -> None:
        try:
            value = result.wait()
        except BaseException as exc:
            entry.future.set_exception(exc)
            done.set_exception(exc)
            return
        entry.future.set_result(value)
        done.set_result(None)

    try:
        value = func(*args, **kwargs)
    except Exception as exc:
        entry.future.set_exception(exc)
        done.set_exception(exc)
        return done
    if is_async_execution(func):
        if not isinstance(value, torch._C.Future):
            error = TypeError(
                f"{getattr(func, '__qualname__', func)} is decorated with @async_execution "
                f"but returned {type(value).__name__}; it must return a torch.futures.Future"
            )
            entry.future.set_exception(error)
            done.set_exception(error)
            return done
        value.add_done_callback(finish)
        return done
    entry.future.set_result(value)
    done.set_result(None)
    return done


@async_execution
def _rref_fetch(rref_id: RRefId) -> torch.futures.Future[Any]:
    return _owner_agent().rrefs.entry(rref_id).future


def _rref_incref(rref_id: RRefId) -> None:
    _owner_agent().rrefs.incref(rref_id)


def _rref_decref_many(rref_ids: list[RRefId]) -> None:
    table = _owner_agent().rrefs
    for rref_id in rref_ids:
        table.decref(rref_id)


def _rref_unpin(fork_id: int) -> None:
    _owner_agent().unpin(fork_id)


@async_execution
def _rref_invoke(
    rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    method = getattr(rref.local_value(), name)
    if is_async_execution(method):
        result: torch.futures.Future[Any] = method(*args, **kwargs)
        return result
    out: torch.futures.Future[Any] = torch.futures.Future()
    try:
        out.set_result(method(*args, **kwargs))
    except Exception as exc:
        out.set_exception(exc)
    return out


def remote_error_text(where: str, exc: BaseException) -> str:
    """torch's remote exception text: where it happened, repr, and the traceback."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"On {where}:\n{exc!r}\n{trace}"
