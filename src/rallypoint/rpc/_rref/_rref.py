"""Remote references: ``RRef``, its proxies, and how it travels between workers.

The owner keeps each value in a table with a count of live ``RRef`` objects anywhere in
the job. Sending an RRef forks it: the sender pins its RRef until the receiver has
registered its own count at the owner, so the count never drops to zero while a fork is
in flight. A garbage-collected RRef queues a decrement, sent to the owner in batches; at
zero the owner drops the value. A call whose arguments carry RRefs forked from a third
worker runs once their owners confirmed them, as in torch. An RRef talks only to its
worker's :class:`~rallypoint.rpc._rref._table.RRefTable`. The lifetime model for users:
docs/rpc.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rallypoint._core.torch_c import distributed_rpc
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._remote_errors import ErrorReply
from rallypoint.rpc._rref._table import (
    CURRENT_TABLE,
    RRefId,
    RRefTable,
    owner_create,
    owner_fetch,
    owner_incref,
    owner_invoke,
    owner_type,
)
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.constants import UNSET_RPC_TIMEOUT
from rallypoint.rpc.dist_autograd._autograd import CURRENT_AUTOGRAD
from rallypoint.rpc.dist_autograd._checks import check_context_id

T = TypeVar("T")
Fork = tuple[str, int]
"""A user RRef's fork id: the worker that made it, and its number there."""


def _unique_id(worker: str, number: int) -> str:
    """torch's ``GloballyUniqueId`` text; ``created_on`` is the worker's rank."""
    agent = CURRENT_AGENT.peek()
    try:
        created_on: int | str = agent.get_worker_info(worker).id if agent else worker
    except RuntimeError:  # a worker that left the group: its name instead
        created_on = worker
    return f"GloballyUniqueId(created_on={created_on}, local_id={number})"


_TORCH_RREF: Any = getattr(distributed_rpc, "PyRRef", None)


class _RRefType(type):
    """``isinstance(x, rpc.RRef)`` holds for torch's RRefs too: the TENSORPIPE backend's
    calls return them, as torch's ``rpc.remote`` does."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or (
            _TORCH_RREF is not None and isinstance(obj, _TORCH_RREF)
        )

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub) or (
            _TORCH_RREF is not None and issubclass(sub, _TORCH_RREF)
        )


class RRef(Generic[T], metaclass=_RRefType):
    """A reference to a value owned by one worker (``torch.distributed.rpc.RRef``'s API).

    ``RRef(value)`` makes a local RRef owned by this worker; ``remote()`` returns one owned
    by the callee. ``isinstance(x, RRef)`` is true of torch's RRefs as well.
    """

    __slots__ = ("__weakref__", "_confirmed", "_fork", "_id", "_owner", "_table", "_type")

    def __new__(cls, *args: Any, **kwargs: Any) -> RRef[Any]:
        if args or kwargs:
            agent = CURRENT_AGENT.peek()
            # a backend with its own RRef type (TENSORPIPE: torch's) makes local RRefs
            foreign = None if agent is None else agent.local_rref(*args, **kwargs)
            if foreign is not None:
                rref: RRef[Any] = foreign
                return rref
        return super().__new__(cls)

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        table = CURRENT_TABLE.peek()
        if table is None:  # torch's message for an RRef made before init_rpc
            raise RpcError(
                "Current RPC agent is not set! Did you initialize the RPC framework "
                "(e.g. by calling `rallypoint.rpc.init_rpc`)?"
            )
        rref_id = table.new_id()
        table.owned.incref(rref_id).future.set_result(value)
        self._setup(table, table.me, rref_id, None, None)

    @classmethod
    def _make(
        cls,
        table: RRefTable,
        owner: WorkerInfo,
        rref_id: RRefId,
        confirmed: torch.futures.Future[Any] | None,
        fork: Fork | None,
    ) -> RRef[Any]:
        rref: RRef[Any] = object.__new__(cls)  # not cls.__new__: no arguments to look at
        rref._setup(table, owner, rref_id, confirmed, fork)
        return rref

    def _setup(
        self,
        table: RRefTable,
        owner: WorkerInfo,
        rref_id: RRefId,
        confirmed: torch.futures.Future[Any] | None,
        fork: Fork | None,
    ) -> None:
        self._table = table
        self._owner = owner
        self._id = rref_id
        self._confirmed = confirmed
        self._fork = fork  # a user RRef's fork id (None on the owner)
        self._type: torch.futures.Future[Any] | None = None

    def __del__(self) -> None:
        # the owner hears of it with the next batch of decrements. A method, not a
        # weakref.finalize: an owner makes an RRef object for every call that passes one
        # to it (a pipeline stage's, every step), and a finalizer costs ten times more to
        # make and run. RRefs cannot be copied (__reduce__ raises), so each object made by
        # _setup is released once; one whose __init__ failed has no table.
        try:
            table, owner, rref_id = self._table, self._owner, self._id
        except AttributeError:
            return
        table.release(owner.name, rref_id)

    def owner(self) -> WorkerInfo:
        """``WorkerInfo`` of the worker that owns the value."""
        return self._owner

    def owner_name(self) -> str:
        return self._owner.name

    def is_owner(self) -> bool:
        return self._owner.name == self._table.me.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has registered this RRef (always true on the owner)."""
        return self._confirmed is None or self._confirmed.done()

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if not self.is_owner():  # torch's words, then how to get the value here
            raise RuntimeError(
                f"For {self._describe('UserRRef(rref_id=', ', fork_id=')}, can't call "
                f"localValue() on user {self._table.me}. Call it on owner {self._owner}, "
                "or use to_here() to copy the value to this worker"
            )
        try:
            value: T = self._table.owned.entry(self._id).future.wait()
        except Exception as exc:  # a failed creation: torch's text, as a remote caller's
            raise ErrorReply.of(self._table.me, exc, type_name=False).rebuild() from None
        return value

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """Copy the value from the owner (the value itself on the owner)."""
        caller = self._table.caller
        try:
            caller.check_open()
        except RpcError:
            if self.is_owner():
                raise
            raise RpcError(  # torch's words: shutdown deleted the user RRefs
                f"User RRef with RRefId={tuple(self._id)} has been deleted. Cannot call "
                "to_here() on it after deletion."
            ) from None
        if self.is_owner():
            return self.local_value()
        value: T = caller.rpc_sync(self._owner, owner_fetch, (self._id,), {}, timeout)
        return value

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass from the value (a scalar tensor), as torch's ``RRef.backward``.

        With ``dist_autograd_ctx_id`` the owner runs a distributed backward pass in that
        context (``dist_autograd.get_gradients`` reads the result); without it (``-1``) a
        local pass on the owner, into ``.grad``, and only the owner may call it.
        """
        if self.is_owner():
            _backward_from(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        args = (self._id, check_context_id(dist_autograd_ctx_id), retain_graph)
        caller = self._table.caller
        error = caller.rpc_sync(self._owner, _owner_backward, args, {}, UNSET_RPC_TIMEOUT)
        if error is not None:  # torch raises the owner's text as it is
            raise RuntimeError(error)

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_sync().method(*a)`` runs ``method`` on the owner's value."""
        return _Proxy(self, PROXY_APIS["rpc_sync"], timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy returning futures: ``rref.rpc_async().method(*a).wait()``."""
        return _Proxy(self, PROXY_APIS["rpc_async"], timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy returning RRefs owned by this RRef's owner."""
        return _Proxy(self, PROXY_APIS["remote"], timeout)

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (torch's private helper; its proxies use it): asked of the
        owner once and cached. With ``blocking=False`` a future of it (the same one on
        every call). A failed creation raises its error."""
        fut = self._type
        if fut is None:
            if self.is_owner():
                fut = owner_type(self._id)
            else:
                caller = self._table.caller
                fut = caller.rpc_async(self._owner, owner_type, (self._id,), {}, timeout)
            self._type = fut
        return fut.wait() if blocking else fut

    def _get_future(self) -> torch.futures.Future[Any]:
        if self._confirmed is not None:
            return self._confirmed
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done

    def __reduce__(self) -> Any:
        raise RuntimeError(
            "Can not pickle rref in python pickler, rref can only be pickled when using RPC"
        )

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self._owner.name}, id={tuple(self._id)})"

    def __str__(self) -> str:
        """torch's text: ``OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))``, or
        ``UserRRef(RRefId = GloballyUniqueId(...), ForkId = GloballyUniqueId(...))``."""
        if self.is_owner():
            return f"OwnerRRef({_unique_id(self._id.creator, self._id.serial)})"
        return self._describe("UserRRef(RRefId = ", ", ForkId = ")

    def _describe(self, head: str, fork: str) -> str:
        text = f"{head}{_unique_id(self._id.creator, self._id.serial)}"
        if self._fork is not None:
            text += f"{fork}{_unique_id(*self._fork)}"
        return text + ")"


def _backward_from(value: Any, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward([value], retain_graph=retain_graph)
    else:
        CURRENT_AUTOGRAD.get().backward(check_context_id(context_id), [value], retain_graph)


def _owner_backward(rref_id: RRefId, context_id: int, retain_graph: bool) -> str | None:
    """On the owner: ``RRef.backward`` of a user RRef; the error's text, if it failed
    (torch's caller raises it as a ``RuntimeError`` with no remote-error wrapping)."""
    try:
        value = CURRENT_TABLE.get().owned.entry(rref_id).future.wait()
        _backward_from(value, context_id, retain_graph)
    except Exception as exc:
        return str(exc)
    return None


PROXY_APIS: dict[str, Callable[..., Any]] = {}
"""The public ``rpc_sync``, ``rpc_async`` and ``remote`` by name (:mod:`._calls` puts them
here): the ``rpc_api`` of the proxies that ``RRef.rpc_sync()`` and the others return."""


class _Proxy:
    """torch's ``RRefProxy``: a plain object whose attributes are torch's (``rref``,
    ``rpc_api``, ``rpc_timeout``, so ``vars()`` and ``__getstate__()`` answer as torch's);
    any other name is a method of the value, run on its owner through ``rpc_api``."""

    def __init__(self, rref: RRef[Any], rpc_api: Callable[..., Any], timeout: float) -> None:
        self.rref = rref
        self.rpc_api = rpc_api
        self.rpc_timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return functools.partial(_proxy_call, self.rref, self.rpc_api, name, self.rpc_timeout)


def _proxy_call(
    rref: RRef[Any],
    rpc_api: Callable[..., Any],
    name: str,
    timeout: float,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if rpc_api is PROXY_APIS["remote"]:
        getattr(rref._get_type(timeout), name)  # as torch's: a missing method raises here
    # as torch's: through the public call, so rpc_async futures join rpc.api._wait_all()
    return rpc_api(rref.owner(), owner_invoke, args=(rref, name, args, kwargs), timeout=timeout)


def remote_rref(
    table: RRefTable, owner: WorkerInfo, payload: tuple[Any, ...], timeout: float
) -> RRef[Any]:
    """``remote()``: ask ``owner`` to run ``payload`` (func, args, kwargs) and own the result."""
    rref_id = table.new_id()
    fork = (table.me.name, table.new_fork_id())
    created = table.caller.rpc_async(owner, owner_create, (rref_id, *payload), {}, timeout)
    return RRef._make(table, owner, rref_id, created, fork)


def reduce_rref(table: RRefTable, rref: RRef[Any]) -> _wire.ReduceValue:
    """Pickle hook: fork ``rref`` to another worker (pins it until the fork registers)."""
    fork_id = table.pin(rref)
    owner = rref._owner
    creator, incarnation, serial = rref._id  # plain values: a named tuple pickles slowly
    return (
        _rref_unpickle,
        (owner.name, owner.id, creator, incarnation, serial, fork_id, table.me.name),
    )


_pending = threading.local()


def collect_confirmations(
    into: list[torch.futures.Future[Any]] | None,
) -> list[torch.futures.Future[Any]] | None:
    """Decoding a call: put the owners' confirmations of the RRefs it forks here into
    ``into`` (the caller waits for them before the call runs); ``None`` stops. Returns
    the list collected into before (a plain swap: it runs for every call served)."""
    saved: list[torch.futures.Future[Any]] | None = getattr(_pending, "futures", None)
    _pending.futures = into
    return saved


def _rref_unpickle(
    owner_name: str,
    owner_id: int,
    creator: str,
    incarnation: int,
    serial: int,
    fork_id: int,
    sender: str,
) -> RRef[Any]:
    table = CURRENT_TABLE.get()
    rref_id = RRefId(creator, incarnation, serial)
    if owner_name == table.me.name:  # back at its owner: a pipeline stage's, every call
        table.owned.incref(rref_id)
        table.unpin_at(sender, fork_id)
        return RRef._make(table, table.me, rref_id, None, None)
    owner = WorkerInfo(owner_name, owner_id)
    confirmed = table.caller.rpc_async(owner, owner_incref, (rref_id,), {}, 0)
    confirmed.add_done_callback(lambda _: table.unpin_at(sender, fork_id))
    pending = getattr(_pending, "futures", None)
    if pending is not None:
        pending.append(confirmed)
    return RRef._make(table, owner, rref_id, confirmed, (sender, fork_id))


PyRRef = RRef
"""torch's ``rpc.PyRRef``: the class of its RRefs, here the same class."""
