"""torch's RPC all-gather and barrier (``rpc.api._all_gather``, ``_barrier``,
``_wait_all_workers``), for programs and tests that call them through ``rpc.api``.

They are private in torch but used outside it. As in torch, they run on plain RPC calls:
the worker with the smallest name among those taking part is the leader; every other
one sends its object to the leader with ``rpc_sync``; once the leader has them all, it
sends the gathered ``{name: object}`` to each follower, which waits for it. Calls are
matched by a sequence number per set of names, counted on every worker in the order it
calls; so the workers of a set call these functions in the same order, as in torch.

rallypoint's own ``shutdown()`` does not use them (see :mod:`._membership`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from rallypoint._core.forking import fork_safe_lock
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._calls import get_rpc_timeout, get_worker_info, rpc_async, rpc_sync
from rallypoint.rpc.constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT


@dataclass(slots=True)
class _Round:
    """One all-gather on this worker: the objects (the leader's, then everyone's)."""

    objects: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Counts:
    """One agent's all-gathers: a new agent (``init_rpc`` again) counts from zero, as its
    peers do."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sequence: dict[tuple[str, ...], int] = field(default_factory=dict)
    rounds: dict[tuple[tuple[str, ...], int], _Round] = field(default_factory=dict)


_by_agent: weakref.WeakKeyDictionary[Any, _Counts] = weakref.WeakKeyDictionary()
_by_agent_lock = fork_safe_lock()


def _counts() -> _Counts:
    agent = CURRENT_AGENT.get()
    with _by_agent_lock:
        counts = _by_agent.get(agent)
        if counts is None:
            counts = _by_agent[agent] = _Counts()
        return counts


def _round(counts: _Counts, key: tuple[tuple[str, ...], int]) -> _Round:
    with counts.lock:
        return counts.rounds.setdefault(key, _Round())


def _gather_to_leader(names: tuple[str, ...], number: int, sender: str, obj: Any) -> None:
    """On the leader: ``sender``'s object for all-gather ``number`` of ``names``."""
    if sender not in names:
        raise ValueError(f"{sender} does not take part in this all-gather of {list(names)}")
    counts = _counts()
    state = _round(counts, (names, number))
    with counts.lock:
        if sender in state.objects:
            raise RuntimeError(f"{sender} sent its object for all-gather {number} twice")
        state.objects[sender] = obj
        complete = len(state.objects) == len(names)
    if complete:
        state.done.set()


def _broadcast_to_followers(names: tuple[str, ...], number: int, objects: dict[str, Any]) -> None:
    """On a follower: the gathered objects of all-gather ``number`` of ``names``."""
    state = _round(_counts(), (names, number))
    state.objects = objects
    state.done.set()


def all_gather(
    obj: Any, worker_names: Collection[str] | None = None, timeout: float = UNSET_RPC_TIMEOUT
) -> dict[str, Any]:
    """``{worker name: obj}`` of every worker in ``worker_names`` (all workers: ``None``)
    once all of them called it. ``timeout`` (seconds) bounds each call and the wait;
    torch's defaults: the RPC timeout for the calls and no bound on the wait, and
    ``DEFAULT_SHUTDOWN_TIMEOUT`` (``0``) for no bound at all."""
    agent = CURRENT_AGENT.get()
    counts = _counts()
    if worker_names:
        names = tuple(sorted(set(worker_names)))
    else:
        names = tuple(sorted(info.name for info in agent.get_worker_infos()))
    me = get_worker_info().name
    if me not in names:
        raise ValueError(f"{me} calls an all-gather of {list(names)} it is not part of")
    if timeout == UNSET_RPC_TIMEOUT:
        call_timeout, wait_timeout = get_rpc_timeout(), None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        call_timeout, wait_timeout = 0.0, None
    else:
        call_timeout = wait_timeout = timeout
    leader = names[0]
    with counts.lock:
        number = counts.sequence.get(names, 0)
        counts.sequence[names] = number + 1
    key = (names, number)
    try:
        if me == leader:
            _gather_to_leader(names, number, me, obj)
        else:
            rpc_sync(leader, _gather_to_leader, args=(names, number, me, obj), timeout=call_timeout)
        state = _round(counts, key)
        if not state.done.wait(wait_timeout):
            raise RuntimeError(
                f"{me} timed out in _all_gather after {wait_timeout:.2f} seconds waiting for "
                f"the objects of {list(names)}"
            )
        if me == leader:
            _send_to_followers(names, number, state.objects, call_timeout)
        return state.objects
    finally:
        with counts.lock:
            counts.rounds.pop(key, None)


def _send_to_followers(
    names: tuple[str, ...], number: int, objects: dict[str, Any], timeout: float
) -> None:
    futures = {
        name: rpc_async(
            name, _broadcast_to_followers, args=(names, number, objects), timeout=timeout
        )
        for name in names[1:]
    }
    errors: list[tuple[str, BaseException]] = []
    for name, future in futures.items():
        try:
            future.wait()
        except RuntimeError as exc:
            errors.append((name, exc))
    if errors:
        raise RuntimeError(
            f"Followers {[name for name, _ in errors]} timed out in _all_gather after "
            f"{timeout:.2f} seconds. The first exception is {errors[0][1]}"
        )


def barrier(worker_names: Collection[str]) -> None:
    """Until every worker in ``worker_names`` called it (torch logs a failure and returns)."""
    try:
        all_gather(None, set(worker_names))
    except RuntimeError:
        logging.getLogger("rallypoint.rpc").exception("Failed to complete barrier")


def wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Until every worker called it (an all-gather of nothing over all workers)."""
    all_gather(None, timeout=timeout)
