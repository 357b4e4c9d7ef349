"""The stacks exchange across nodes, through any store with torch's ``set/get/add/check``.

``rallypoint stacks --rdzv-endpoint ... --rdzv-id ...``, or the agent that detected a hang,
calls :func:`request_stacks`: it bumps a request counter and waits. Every agent polls
:func:`answer_stacks_request` from its monitor loop (one ``add`` per tick when idle),
collects its workers' stacks and publishes them as JSON. Pass a ``PrefixStore`` for the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Protocol

from rallypoint.observe._stacks import StackDump, positive_seconds

__all__ = [
    "StacksStore",
    "answer_stacks_request",
    "latest_stacks_request",
    "publish_node_count",
    "request_stacks",
]


class StacksStore(Protocol):
    """The part of torch's ``c10d.Store`` the exchange uses (TCPStore, FileStore, ...)."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, amount: int, /) -> int: ...
    def check(self, keys: list[str], /) -> bool: ...


_REQUEST = "stacks/request"
_NNODES = "stacks/nnodes"


def publish_node_count(store: StacksStore, nnodes: int) -> None:
    """Agents call this after each round so that a requester knows how many answers to expect."""
    store.set(_NNODES, str(nnodes))


def latest_stacks_request(store: StacksStore) -> int:
    """The newest request id; an agent starts answering after this one."""
    return store.add(_REQUEST, 0)


def answer_stacks_request(
    store: StacksStore,
    *,
    node_rank: int,
    answered: int,
    collect: Callable[[], Mapping[int, StackDump]],
) -> int:
    """Answer requests newer than ``answered`` (collecting once); return the newest answered.

    Cheap when there is nothing to do: one ``add(key, 0)`` round trip.
    """
    latest = store.add(_REQUEST, 0)
    if latest <= answered:
        return answered
    payload = json.dumps([d.to_json() for d in collect().values()])
    for n in range(max(answered + 1, latest - 8), latest + 1):  # skip requests long gone
        store.set(f"stacks/{n}/node/{node_rank}", payload)
        store.add(f"stacks/{n}/count", 1)
    return latest


def request_stacks(
    store: StacksStore,
    *,
    timeout: timedelta | float,
    nnodes: int | None = None,
) -> tuple[dict[int, StackDump], dict[int, str]]:
    """Ask every agent for its workers' stacks and wait for ``nnodes`` answers or ``timeout``.

    Returns the dumps by global rank, and ``{node_rank: why}`` for nodes that did not answer
    or answered garbage. ``nnodes=None`` uses the count the agents published; ``ValueError``
    if there is none (no agent of this run is running).
    """
    limit = positive_seconds(timeout)
    if nnodes is None:
        if not store.check([_NNODES]):
            raise ValueError("no agent of this run has published its node count: is it running?")
        raw = store.get(_NNODES).decode(errors="replace")
        if not raw.isdigit():
            raise ValueError(f"the store holds a bad node count {raw!r} under {_NNODES!r}")
        nnodes = int(raw)
    n = store.add(_REQUEST, 1)
    deadline = time.monotonic() + limit
    while store.add(f"stacks/{n}/count", 0) < nnodes and time.monotonic() < deadline:
        time.sleep(0.02)
    dumps: dict[int, StackDump] = {}
    missing: dict[int, str] = {}
    for node in range(nnodes):
        key = f"stacks/{n}/node/{node}"
        if not store.check([key]):
            missing[node] = f"no answer within {limit:g} s"
            continue
        try:
            records = json.loads(store.get(key))
            if not isinstance(records, list):
                raise ValueError(f"expected a list, got {type(records).__name__}")
            for record in records:
                dump = StackDump.from_json(record)
                dumps[dump.rank] = dump
        except ValueError as exc:
            missing[node] = f"unreadable answer: {exc}"
    return dict(sorted(dumps.items())), missing
