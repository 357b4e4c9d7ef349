"""The stacks exchange across nodes, through any store with torch's ``set/get/add/check``.

``rallypoint stacks``, or the agent that detected a hang, calls :func:`request_stacks`:
it bumps a request counter and waits. Every agent polls :func:`answer_stacks_request`
from its monitor loop (one ``add`` per tick when idle), collects its workers' stacks and
publishes them as JSON; the requester deletes each answer as it reads it. Pass a
``PrefixStore`` for the run. Any client of the store can bump the counter, so what a
request makes an agent write is bounded (:class:`StacksAnswers`); any client can also
overwrite it with something else, which is :class:`MalformedRequestCounter` (the counter
is read with ``compare_set``, never ``add``: torch's TCPStore server drops the connection
of a client that adds to a value that is not a number).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

from rallypoint._core.store import Store
from rallypoint._watch._flight._records import RankTrace
from rallypoint._watch._stacks import StackDump, ThreadStack, positive_seconds

__all__ = [
    "KEEP_FOR",
    "MAX_ANSWER_BYTES",
    "MAX_KEPT",
    "MIN_ANSWER_INTERVAL",
    "MalformedRequestCounter",
    "StacksAnswers",
    "answer_stacks_request",
    "latest_stacks_request",
    "publish_node_count",
    "request_stacks",
]

MAX_ANSWER_BYTES = 1 << 20
"""Most bytes of one node's answer to one request."""
MIN_ANSWER_INTERVAL = 1.0
"""Seconds between two answers of one agent, at least."""
KEEP_FOR = 120.0
"""Seconds an agent's answer stays in the store if nobody collects it."""
MAX_KEPT = 4
"""Most answers of one agent in the store at a time (the oldest goes first)."""
_SCAN_EVERY = 5.0
"""Seconds between the requester's reads of the answers already there, while it waits."""


_REQUEST = "stacks/request"
_NNODES = "stacks/nnodes"


class MalformedRequestCounter(ValueError):
    """The request counter holds something that is not a count; ``value`` is what."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        super().__init__(self.message(""))

    def message(self, prefix: str) -> str:
        """What is wrong, naming the key under the run store's ``prefix``."""
        key = f"{prefix}/{_REQUEST}" if prefix else _REQUEST
        return f"the key {key!r} holds {self.value[:40]!r}, not a request count"


def _answer_key(request: int, node_rank: int) -> str:
    return f"stacks/{request}/node/{node_rank}"


def _count_key(request: int) -> str:
    return f"stacks/{request}/count"


def publish_node_count(store: Store, nnodes: int) -> None:
    """Agents call this after each round so that a requester knows how many answers to expect."""
    store.set(_NNODES, str(nnodes))


def latest_stacks_request(store: Store) -> int:
    """The newest request id; an agent starts answering after this one.
    :class:`MalformedRequestCounter` if the counter holds something else."""
    raw = bytes(store.compare_set(_REQUEST, "", "0"))  # one round trip; sets an absent one
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():  # a counter never goes below 0
        raise MalformedRequestCounter(raw)
    return int(text)


# ---------------------------------------------------------------------------- the agent


@dataclass(kw_only=True, slots=True)
class StacksAnswers:
    """One agent's side of the exchange: the newest request it answered, when, and its
    answers still in the store. The bounds default to the module's constants.

    One answer per :data:`MIN_ANSWER_INTERVAL` at most, to the newest request only (a burst
    of requests costs one collection); an answer of at most :data:`MAX_ANSWER_BYTES` (beyond,
    the main threads only, then no stacks, with a note that says so); at most
    :data:`MAX_KEPT` answers of the node in the store at a time, each removed after
    :data:`KEEP_FOR` seconds if nobody collected it.
    """

    answered: int = 0
    max_bytes: int = MAX_ANSWER_BYTES
    min_interval: float = MIN_ANSWER_INTERVAL
    keep_for: float = KEEP_FOR
    max_kept: int = MAX_KEPT
    last_at: float = float("-inf")
    kept: deque[tuple[float, int]] = field(default_factory=deque)
    """``(when written, request id)`` of the answers it may still have to remove."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 or self.max_kept < 1:
            raise ValueError("max_bytes must be >= 1024 and max_kept >= 1")


def answer_stacks_request(
    store: Store,
    *,
    node_rank: int,
    answers: StacksAnswers,
    collect: Callable[[], Mapping[int, StackDump]],
) -> None:
    """Answer the newest request if it is newer than the last one answered and the last
    answer is ``min_interval`` old; remove this node's answers nobody collected.

    Cheap when there is nothing to do: one ``compare_set`` round trip.
    :class:`MalformedRequestCounter` if the request counter holds something else.
    """
    _remove_old(store, node_rank, answers, time.monotonic())
    latest = latest_stacks_request(store)
    if latest <= answers.answered or time.monotonic() - answers.last_at < answers.min_interval:
        return
    payload = bounded_answer(collect().values(), answers.max_bytes)
    store.set(_answer_key(latest, node_rank), payload)
    store.add(_count_key(latest), 1)
    answers.answered = latest
    answers.last_at = time.monotonic()
    answers.kept.append((answers.last_at, latest))
    while len(answers.kept) > answers.max_kept:
        _remove(store, node_rank, answers.kept.popleft()[1])


def _remove_old(store: Store, node_rank: int, answers: StacksAnswers, now: float) -> None:
    while answers.kept and now - answers.kept[0][0] >= answers.keep_for:
        _remove(store, node_rank, answers.kept.popleft()[1])


def _remove(store: Store, node_rank: int, request: int) -> None:
    """This node's answer to ``request``, and the request's count: the requester has
    given up on it by now (and deleted both if it read the answer)."""
    store.delete_key(_answer_key(request, node_rank))
    store.delete_key(_count_key(request))


def bounded_answer(dumps: Iterable[StackDump], max_bytes: int) -> str:
    """The JSON answer of a node: ``{"dumps": [...], "note": ...}`` in ``max_bytes`` at
    most. Over it: the main threads only, without source lines or the Flight Recorder's
    frames; then no stacks; then only the ranks that fit; ``note`` says which."""
    dumps = list(dumps)
    full = _encode(dumps, None)
    if len(full.encode()) <= max_bytes:
        return full
    over = f"over {max_bytes} bytes"
    slim = _encode([_slim(d) for d in dumps], f"{over}: only main threads, no source lines")
    if len(slim.encode()) <= max_bytes:
        return slim
    why = f"stacks left out: this node's answer was {over}"
    records = [StackDump(rank=d.rank, host=d.host, pid=d.pid, error=why) for d in dumps]
    while True:  # a node of very many ranks: those that fit
        left = len(dumps) - len(records)
        bare = _encode(records, why + (f"; {left} ranks not listed" if left else ""))
        size = len(bare.encode())
        if size <= max_bytes or not records:
            return bare
        per_record = size / len(records)
        del records[max(0, min(len(records) - 1, int(max_bytes / per_record) - 1)) :]


def _encode(dumps: list[StackDump], note: str | None) -> str:
    return json.dumps({"dumps": [d.to_json() for d in dumps], "note": note})


def _slim(dump: StackDump) -> StackDump:
    main = dump.main
    threads: tuple[ThreadStack, ...] = ()
    if main is not None:
        frames = tuple(replace(f, source="") for f in main.frames)
        threads = (ThreadStack(main.thread_id, main.current, frames),)
    return replace(dump, threads=threads, flight=_frameless(dump.flight))


def _frameless(trace: RankTrace | None) -> RankTrace | None:
    if trace is None:
        return None
    groups = tuple(
        replace(g, entries=tuple(replace(e, frames=()) for e in g.entries)) for g in trace.groups
    )
    return replace(trace, groups=groups)


# ---------------------------------------------------------------------------- the requester


def request_stacks(
    store: Store,
    *,
    timeout: timedelta | float,
    nnodes: int | None = None,
) -> tuple[dict[int, StackDump], dict[int, str]]:
    """Ask every agent for its workers' stacks and wait for ``nnodes`` answers or ``timeout``.

    Returns the dumps by global rank, and ``{node_rank: why}`` for nodes that did not
    answer, answered garbage, or answered in part (over the size cap). Each answer is
    deleted from the store once read. ``nnodes=None`` uses the count the agents
    published; ``ValueError`` if there is none (no agent of this run is running), and
    :class:`MalformedRequestCounter` if the request counter is not a count.
    """
    limit = positive_seconds(timeout)
    if nnodes is None:
        if not store.check([_NNODES]):
            raise ValueError("no agent of this run has published its node count: is it running?")
        raw = store.get(_NNODES).decode(errors="replace")
        if not raw.isdigit():
            raise ValueError(f"the store holds a bad node count {raw!r} under {_NNODES!r}")
        nnodes = int(raw)
    latest_stacks_request(store)  # a malformed counter: not added to (see the module doc)
    n = store.add(_REQUEST, 1)
    deadline = time.monotonic() + limit
    dumps: dict[int, StackDump] = {}
    missing: dict[int, str] = {}
    waiting = set(range(nnodes))
    scan_at = time.monotonic() + _SCAN_EVERY
    while waiting:
        now = time.monotonic()
        counted = store.add(_count_key(n), 0) >= nnodes  # each node counts its answer once
        if counted or now >= scan_at or now >= deadline:  # and now and then: an answer
            _collect(store, n, waiting, dumps, missing)  # whose count was lost is read too
            scan_at = now + _SCAN_EVERY
        if not waiting or now >= deadline:
            break
        time.sleep(0.02)
    store.delete_key(_count_key(n))
    for node in waiting:
        missing[node] = f"no answer within {limit:g} s"
    return dict(sorted(dumps.items())), dict(sorted(missing.items()))


def _collect(
    store: Store,
    request: int,
    waiting: set[int],
    dumps: dict[int, StackDump],
    missing: dict[int, str],
) -> None:
    """Read (and delete) the answers of the nodes in ``waiting`` that are there."""
    for node in sorted(waiting):
        key = _answer_key(request, node)
        if not store.check([key]):
            continue
        raw = store.get(key)
        store.delete_key(key)
        waiting.discard(node)
        try:
            answer = json.loads(raw)
            if not isinstance(answer, dict) or not isinstance(answer.get("dumps"), list):
                raise ValueError(f'expected {{"dumps": [...]}}, got {type(answer).__name__}')
            for record in answer["dumps"]:
                dump = StackDump.from_json(record)
                dumps[dump.rank] = dump
            if answer.get("note"):
                missing[node] = f"answered in part: {answer['note']}"
        except ValueError as exc:
            missing[node] = f"unreadable answer: {exc}"
