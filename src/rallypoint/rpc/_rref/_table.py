"""This worker's RRef bookkeeping, and the functions that run on an RRef's owner.

:class:`RRefTable` holds the values this worker owns with their counts of live RRefs,
the RRefs pinned while a fork of them is in flight, and the decrements waiting to be sent
(the lifetime model is described in :mod:`rallypoint.rpc._rref._rref`). The agent owns one
table, sends through it (a :class:`~rallypoint.rpc._backend.Caller`) and flushes its
decrements from its monitor; remote calls find it through :data:`CURRENT_TABLE`.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from rallypoint._core.torch_c import Future
from rallypoint.rpc._backend import Caller
from rallypoint.rpc._current import Current
from rallypoint.rpc._remote_errors import plain_errors
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.functions import async_execution, is_async_execution, no_future_error

if TYPE_CHECKING:
    from rallypoint.rpc._rref._rref import RRef


class RRefId(NamedTuple):
    """Names one owned value: its creator, the creator's incarnation and a serial number."""

    creator: str
    incarnation: int
    serial: int


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


class RRefTable:
    """Owned values, pinned forks, RRef ids and pending decrements of one worker."""

    def __init__(self, me: WorkerInfo, caller: Caller) -> None:
        self.me = me
        self.caller = caller
        self.owned = OwnerTable()
        self._incarnation = secrets.randbits(31)
        # one sequence for RRef ids and fork ids, as torch's (its ids print the same)
        self._serials = itertools.count()
        self._pins: dict[int, RRef[Any]] = {}
        self._releases: queue.SimpleQueue[tuple[str, RRefId]] = queue.SimpleQueue()
        self._unpins: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._closed = False

    def __len__(self) -> int:
        """How many values this worker owns."""
        return len(self.owned)

    def new_id(self) -> RRefId:
        return RRefId(self.me.name, self._incarnation, next(self._serials))

    def new_fork_id(self) -> int:
        """A fork id: a user RRef's, made here (torch's fork ids share the RRef ids' count)."""
        return next(self._serials)

    # ---- forks in flight ---------------------------------------------------------------
    def pin(self, rref: RRef[Any]) -> int:
        """Keep ``rref`` alive until the fork sent as ``fork_id`` is registered."""
        fork_id = self.new_fork_id()
        self._pins[fork_id] = rref
        return fork_id

    def unpin(self, fork_id: int) -> None:
        self._pins.pop(fork_id, None)

    def unpin_at(self, sender: str, fork_id: int) -> None:
        """Tell ``sender`` (maybe this worker) that its fork ``fork_id`` is registered.

        A remote sender hears it with the next batch of decrements: its RRef stays pinned
        a few milliseconds longer, and a call that forks RRefs costs no extra message.
        """
        if sender == self.me.name:
            self.unpin(fork_id)
        elif not self._closed:
            self._unpins.put((sender, fork_id))

    # ---- decrements --------------------------------------------------------------------
    def release(self, owner: str, rref_id: RRefId) -> None:
        """An RRef object died: queue a decrement for its owner (sent in batches)."""
        if not self._closed:
            self._releases.put((owner, rref_id))

    def has_releases(self) -> bool:
        return not self._releases.empty() or not self._unpins.empty()

    def send_releases(self, reachable: Callable[[str], bool]) -> None:
        """Apply this worker's own decrements; send the others (and unpins) in batches."""
        unpins: dict[str, list[int]] = {}
        while True:
            try:
                sender, fork_id = self._unpins.get_nowait()
            except queue.Empty:
                break
            unpins.setdefault(sender, []).append(fork_id)
        for sender, fork_ids in unpins.items():
            if reachable(sender):
                self.caller.oneway(sender, owner_unpin_many, fork_ids)
        batches: dict[str, list[RRefId]] = {}
        while True:
            try:
                owner, rref_id = self._releases.get_nowait()
            except queue.Empty:
                break
            batches.setdefault(owner, []).append(rref_id)
        for owner, ids in batches.items():
            if owner == self.me.name:
                for rref_id in ids:
                    self.owned.decref(rref_id)
            elif reachable(owner):
                self.caller.oneway(owner, owner_decref_many, ids)

    def close(self) -> None:
        self._closed = True
        self._pins.clear()
        self.owned.clear()


CURRENT_TABLE: Current[RRefTable] = Current()


# ---- functions that run on the owner ---------------------------------------------------
def _settle(
    entry: _Entry, done: torch.futures.Future[Any], value: Any, exc: BaseException | None
) -> None:
    # the creation's reply goes out before any to_here() reply waiting on the value, so a
    # caller whose to_here() returned sees its RRef confirmed by the owner
    if exc is not None:
        done.set_exception(exc)
        entry.future.set_exception(exc)
    else:
        done.set_result(None)
        entry.future.set_result(value)


@async_execution
def owner_create(
    rref_id: RRefId, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    entry = CURRENT_TABLE.get().owned.incref(rref_id)
    done: torch.futures.Future[Any] = torch.futures.Future()

    def finish(result: torch.futures.Future[Any]) -> None:
        try:
            value = result.wait()
        except BaseException as exc:  # anything, SystemExit too, settles the RRef
            _settle(entry, done, None, exc)
            return
        _settle(entry, done, value, None)

    try:
        value = func(*args, **kwargs)
    except Exception as exc:
        _settle(entry, done, None, exc)
        return done
    if not is_async_execution(func):
        _settle(entry, done, value, None)
    elif isinstance(value, Future):
        value.add_done_callback(finish)
    else:
        _settle(entry, done, None, no_future_error(func, value))
    return done


@plain_errors  # torch's to_here() raises the error as it was, with no type name first
@async_execution
def owner_fetch(rref_id: RRefId) -> torch.futures.Future[Any]:
    return CURRENT_TABLE.get().owned.entry(rref_id).future


@async_execution
def owner_type(rref_id: RRefId) -> torch.futures.Future[Any]:
    """The type of an owned value, once it exists (its creation's error otherwise)."""
    created = CURRENT_TABLE.get().owned.entry(rref_id).future
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            out.set_result(type(fut.wait()))
        except Exception as exc:
            out.set_exception(exc)

    created.add_done_callback(done)
    return out


def owner_incref(rref_id: RRefId) -> None:
    CURRENT_TABLE.get().owned.incref(rref_id)


def owner_decref_many(rref_ids: list[RRefId]) -> None:
    owned = CURRENT_TABLE.get().owned
    for rref_id in rref_ids:
        owned.decref(rref_id)


def owner_unpin_many(fork_ids: list[int]) -> None:
    table = CURRENT_TABLE.get()
    for fork_id in fork_ids:
        table.unpin(fork_id)


@async_execution
def owner_invoke(
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
