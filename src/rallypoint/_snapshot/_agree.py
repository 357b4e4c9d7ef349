"""Agreement through the workers' store: which step every rank restores, and when a save
is complete everywhere.

Under ``rallypoint run`` the workers' store is fresh every round, so no key of an earlier
round is ever read. A snapshot is known by ``(generation, step)``: the saves after a
restore form a new generation, so a step written before a restore is never mixed with
the same step written after it. Every rank votes with the snapshots it can restore (from
a node's memory or a checkpoint on disk) and all pick the newest one every rank has; a
rank writes its next snapshot only once the previous one is complete everywhere, so two
slots per rank are enough. The keys: :class:`Agreement`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from rallypoint._snapshot._records import Key
from rallypoint._snapshot._snapshot_dir import Checkpoint

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = ["Agreement", "Choice", "Holder", "next_generation"]

PREFIX = "rallypoint/snapshot"


@dataclass(frozen=True, slots=True)
class Holder:
    world: int
    key: Key
    addr: str


@dataclass(slots=True)
class Choice:
    """What every rank restores: a snapshot in memory, a step on disk, or nothing."""

    memory: Key | None = None
    holders: list[str] = field(default_factory=list)
    disk: list[Checkpoint] = field(default_factory=list)
    """The checkpoints on disk every rank can see, newest first."""
    other_worlds: set[int] = field(default_factory=set)
    """World sizes this rank's in-memory snapshots were saved with, other than this one."""


def next_generation(previous: str | None) -> str:
    """A fresh generation, ordered after ``previous`` (``<count>.<random>``)."""
    count = int(previous.split(".")[0]) + 1 if previous else 0
    return f"{count}.{secrets.token_hex(4)}"


def _gen_order(gen: str) -> int:
    head = gen.split(".")[0]
    return int(head) if head.isdigit() else -1


def parse_where(text: str) -> list[Holder]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0].isdigit() and parts[2].lstrip("-").isdigit():
            out.append(Holder(int(parts[0]), (parts[1], int(parts[2])), parts[3]))
    return out


class Agreement:
    """One worker's view of the agreement keys (``store`` is a client of the workers' store).

    Keys, under ``rallypoint/snapshot/``:

    - ``server/<group rank>``: ``host:port`` of that node's snapshot server (the replica of
      node ``g`` is node ``g + 1`` mod the node count);
    - ``ranks/<group rank>``: ``first count``, the global ranks of that node's workers;
    - ``gen/<n>``: the generation of the saves after the ``n``-th restore of this round
      (``0``: no restore), set once with ``compare_set``;
    - ``r<n>/where/<rank>``: every node's local rank 0 appends one line per complete
      snapshot its server holds (``world gen step host:port``); ``r<n>/nodes`` counts nodes
      that did; ``r<n>/have/<gen>/<step>`` and ``r<n>/disk/<name>`` count the ranks that can
      restore that snapshot from memory or the checkpoint ``<name>`` from disk;
      ``r<n>/voted`` counts the ranks that voted. The answer is the newest snapshot every
      rank counted. ``r<n>/loaded`` counts the ranks that loaded theirs: after it, each
      node's server may drop what no rank fetches any more; ``r<n>/load<i>/*`` count the
      ranks that tried the ``i``-th checkpoint on disk and those that failed to load it
      (then every rank tries the next one);
    - ``<gen>/done/<step>``: ranks whose save of ``step`` is complete (local copy and
      replica); the last one sets ``<gen>/all/<step>``. A rank writes its next snapshot only
      after that, so the slot it overwrites never holds the only complete copy of a step
      some rank still needs.
    """

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world: int,
        group_rank: int,
        group_world: int,
        timeout: timedelta,
    ) -> None:
        from rallypoint._core.torch_c import PrefixStore, as_torch_store

        self.store: Store = PrefixStore(PREFIX, as_torch_store(store))
        self.rank = rank
        self.world = world
        self.group_rank = group_rank
        self.group_world = group_world
        self.timeout = timeout

    def _count_and_wait(self, counter: str, total: int, done: str) -> None:
        if int(self.store.add(counter, 1)) == total:
            self.store.set(done, "1")
        self.store.wait([done], self.timeout)

    # ------------------------------------------------------------------ servers
    def publish_server(self, addr: str, first_rank: int, local_world: int) -> None:
        self.store.set(f"server/{self.group_rank}", addr)
        self.store.set(f"ranks/{self.group_rank}", f"{first_rank} {local_world}")

    def upstream_ranks(self) -> list[int]:
        """The ranks of the node this node holds the replicas of (none on one node)."""
        if self.group_world < 2:
            return []
        key = f"ranks/{(self.group_rank - 1) % self.group_world}"
        self.store.wait([key], self.timeout)
        first, count = map(int, bytes(self.store.get(key)).decode().split())
        return list(range(first, first + count))

    def replica_server(self) -> str | None:
        """The server that holds this node's replicas (``None`` on a one-node job)."""
        if self.group_world < 2:
            return None
        key = f"server/{(self.group_rank + 1) % self.group_world}"
        self.store.wait([key], self.timeout)
        return bytes(self.store.get(key)).decode()

    def generation(self, n: int, candidate: str) -> str:
        """The generation after the ``n``-th restore (the first rank's ``candidate``)."""
        return bytes(self.store.compare_set(f"gen/{n}", "", candidate)).decode()

    def loaded(self, n: int) -> None:
        """This rank loaded its part of the ``n``-th restore; waits for every rank."""
        self._count_and_wait(f"r{n}/loaded", self.world, f"r{n}/loaded_all")

    # ------------------------------------------------------------------ restoring
    def choose(
        self,
        n: int,
        *,
        inventory: Callable[[], Iterable[tuple[int, int, Key]]] | None,
        server: str,
        disk: Iterable[Checkpoint],
    ) -> Choice:
        """The ``n``-th restore of this round; ``inventory`` only on the node's local rank 0
        (``(rank, world, key)`` of every complete snapshot its server holds)."""
        s, r = self.store, f"r{n}"
        if inventory is not None:
            for rank, world, (gen, step) in inventory():
                s.append(f"{r}/where/{rank}", f"{world} {gen} {step} {server}\n")
            self._count_and_wait(f"{r}/nodes", self.group_world, f"{r}/nodes_all")
        else:
            s.wait([f"{r}/nodes_all"], self.timeout)
        where = f"{r}/where/{self.rank}"
        holders = parse_where(bytes(s.get(where)).decode()) if s.check([where]) else []
        mine: dict[Key, list[str]] = {}
        choice = Choice()
        for h in holders:
            if h.world == self.world:
                mine.setdefault(h.key, []).append(h.addr)
            else:
                choice.other_worlds.add(h.world)
        checkpoints = list(dict.fromkeys(disk))  # newest first (every rank sorts alike)
        for gen, step in mine:
            s.add(f"{r}/have/{gen}/{step}", 1)
        for ck in checkpoints:
            s.add(f"{r}/disk/{ck.name}", 1)
        self._count_and_wait(f"{r}/voted", self.world, f"{r}/voted_all")
        everywhere = [k for k in mine if int(s.add(f"{r}/have/{k[0]}/{k[1]}", 0)) == self.world]
        if everywhere:
            best = max(everywhere, key=lambda k: (k[1], _gen_order(k[0]), k[0]))
            choice.memory = best
            local = [a for a in mine[best] if a == server]
            choice.holders = local + [a for a in mine[best] if a != server]
        choice.disk = [
            ck for ck in checkpoints if int(s.add(f"{r}/disk/{ck.name}", 0)) == self.world
        ]
        return choice

    def all_loaded(self, n: int, attempt: int, ok: bool) -> bool:
        """Whether every rank loaded the ``attempt``-th checkpoint of the ``n``-th restore
        (this rank: ``ok``); waits for every rank."""
        r = f"r{n}/load{attempt}"
        self.store.add(f"{r}/failed", 0 if ok else 1)
        self._count_and_wait(f"{r}/tried", self.world, f"{r}/all")
        return int(self.store.add(f"{r}/failed", 0)) == 0

    # ------------------------------------------------------------------ saving
    def save_done(self, key: Key) -> None:
        """This rank's save of ``key`` is complete; waits until every rank's is."""
        gen, step = key
        self._count_and_wait(f"{gen}/done/{step}", self.world, f"{gen}/all/{step}")
