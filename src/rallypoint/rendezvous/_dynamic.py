"""The dynamic rendezvous handler: rounds of O(1) store operations per node.

Torch's dynamic handler keeps one pickled state blob that every node rewrites by
compare-and-set, so a round costs O(N^2). Here a node joining a round takes a slot with
one ``add``, writes its descriptor, and blocks server-side until the round's final record
appears; exactly one node (claimed with a set-if-absent) reads all slots, assigns ranks
(survivors keep theirs) and writes them. A node that finds the round final waits for the
next one and counts as waiting. Heartbeats are one ``add`` per interval and each member
watches the next two ranks, so ``num_nodes_waiting()`` also reports presumed-dead
members. Key names: ``_rounds``; the steps: docs/rendezvous.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rallypoint._core.forking import fork_safe_lock
from rallypoint.rendezvous._api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from rallypoint.rendezvous._background import Background
from rallypoint.rendezvous._config import DynamicRendezvousConfig
from rallypoint.rendezvous._endpoint import local_fqdn
from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError, KVStateError
from rallypoint.rendezvous._rounds import (
    CLOSED,
    LEFT,
    Final,
    Keys,
    Slot,
    Watch,
    assign_ranks,
    corrupt_record,
    parse_int,
)

if TYPE_CHECKING:
    from rallypoint._core.store import Store
    from rallypoint._core.torch_c import TCPStore, TorchStore

logger = logging.getLogger("rallypoint.rendezvous")

_SPARE_WAIT = timedelta(days=1)
_SLOT_WAIT = timedelta(seconds=5)
_NOW = timedelta(0)


class DynamicRendezvousHandler(RendezvousHandler):
    """A node of an elastic job: each instance is one node, even within one process.

    Args:
        kv: the store (see ``_kv.py``); the handler uses ``kv.clone()`` for its thread.
        config: the settings.
        backend_name: what :meth:`get_backend` returns.
        keep: objects to keep alive as long as the handler (e.g. a hosted TCPStore).
        hosts_store: whether ``keep`` holds the server of the rendezvous store itself.
    """

    _local_ids = iter(range(1 << 62))
    _local_ids_lock = fork_safe_lock()

    def __init__(
        self,
        kv: KeyValueStore,
        config: DynamicRendezvousConfig,
        *,
        backend_name: str = "c10d",
        keep: Sequence[Any] = (),
        hosts_store: bool = False,
    ) -> None:
        self._kv = kv
        self._config = config
        self._backend_name = backend_name
        self._keep = list(keep)
        self._hosts_store = hosts_store
        self._keys = Keys(config.run_id)
        self._addr = config.local_addr or local_fqdn()
        with DynamicRendezvousHandler._local_ids_lock:
            local_id = next(DynamicRendezvousHandler._local_ids)
        self._node = f"{self._addr}_{os.getpid()}_{local_id}_{secrets.token_hex(3)}"
        self._lock = threading.Lock()
        self._round: int | None = None
        self._rank: int | None = None
        self._world = 0
        self._watch: dict[bool, Watch] = {}
        self._heartbeat_task: int | None = None
        self._agent_server: TCPStore | None = None
        self._side_kv: KeyValueStore | None = None
        self._bg: Background[KeyValueStore] = Background(f"rdzv-{local_id}", kv.clone)

    # ---------------------------------------------------------------- public API

    @property
    def settings(self) -> DynamicRendezvousConfig:
        """The settings this handler runs with."""
        return self._config

    @property
    def node_id(self) -> str:
        """This node's unique id in the store (address, pid, local counter, random)."""
        return self._node

    @property
    def hosts_store(self) -> bool:
        """Whether this process serves the rendezvous store (c10d, the endpoint's node)."""
        return self._hosts_store

    @property
    def store_endpoint(self) -> str:
        """Where the rendezvous store lives (``host:port`` with the real port when this
        node hosts a TCPStore on port 0, a path, or etcd URLs)."""
        return self._kv.endpoint

    @property
    def round(self) -> int | None:
        """The round this node was last admitted to (``None`` before the first)."""
        return self._round

    def open_run_store(self, namespace: str) -> TorchStore:
        """A new connection to the run's store, keys under ``namespace``."""
        return self._kv.clone().torch_store(namespace)

    def liveness_window(self) -> timedelta:
        interval = self._config.keep_alive_interval.total_seconds()
        return timedelta(seconds=self._dead_after() + 2 * interval)

    def get_backend(self) -> str:
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        return self._config.use_agent_store and (
            os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"
        )

    def get_run_id(self) -> str:
        return self._config.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._config.join_timeout.total_seconds()
        with self._errors():
            rank, world, k = self._next_round(deadline)
            store = self._kv.torch_store(self._keys.store(k))
            try:
                info = self._bootstrap(rank, store)
            except (RuntimeError, LookupError, ValueError) as exc:
                raise RendezvousConnectionError(
                    f"Round {k} of '{self._config.run_id}': rank {rank} could not publish or "
                    f"read the workers' store address: {type(exc).__name__}: {exc}"
                ) from exc
        logger.info(
            "node %s joined round %d of rendezvous %r as rank %d of %d",
            self._node,
            k,
            self._config.run_id,
            rank,
            world,
        )
        return RendezvousInfo(store, rank, world, info)

    def is_closed(self) -> bool:
        with self._errors():
            return self._side().get(self._keys.closed) is not None

    def set_closed(self) -> None:
        """Close the run for every node within ``close_timeout``.

        Raises:
            RendezvousTimeoutError: the store did not take the close within
                ``close_timeout`` (the close goes on in the background).
            RendezvousConnectionError: the store cannot be reached.
        """
        self._close_within_timeout()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to be admitted, plus members presumed dead: > 0 means re-rendezvous.

        Late nodes count only while the round has room (spares beyond ``max_nodes`` do
        not); once any node has started the next round, that counts too.
        """
        with self._lock:
            k, world = self._round, self._world
        if k is None:
            return 0
        with self._errors():
            side = self._side()
            late, dead = side.multi_get([self._keys.r(k, "late"), self._keys.r(k, "dead")])
            nxt = side.enrolled(self._keys.r(k + 1, "joined"))
        waiting = parse_int(late, "late") if world < self._config.max_nodes else 0
        return max(waiting, nxt) + parse_int(dead, "dead")

    def num_nodes_dead(self) -> int:
        """Members of this node's round presumed dead (missed heartbeats)."""
        with self._lock:
            k = self._round
        if k is None:
            return 0
        with self._errors():
            return parse_int(self._side().get(self._keys.r(k, "dead")), "dead")

    def leave(self) -> None:
        """This node leaves the job for good while the others go on (it was excluded):
        stop its heartbeats and count it gone in its round at once, so that the next
        round expects one node fewer instead of waiting for it (``last_call_timeout``)."""
        self._bg.stop()
        with self._lock:
            k = self._round
        if k is not None:
            with self._errors():
                self._kv.add(self._keys.r(k, "dead"), 1)

    def shutdown(self) -> bool:
        """Stop heartbeats and close the run (as torch's handler does)."""
        self._bg.stop()
        try:
            self._close_within_timeout()
        except (RendezvousConnectionError, RendezvousStateError, RendezvousTimeoutError) as exc:
            logger.warning("node %s failed to close the rendezvous: %s", self._node, exc)
            return False
        return True

    # ---------------------------------------------------------------- rounds

    def _next_round(self, deadline: float) -> tuple[int, int, int]:
        kv, keys = self._kv, self._keys
        if kv.get(keys.closed) is not None:
            raise RendezvousClosedError(f"The rendezvous '{self._config.run_id}' is closed.")
        with self._lock:
            previous = self._round
        start = 0
        if previous is not None:
            start = previous + 1
            self._open(kv, start)
        k = self._find_round(kv, start)
        while True:
            raw = kv.get(keys.r(k, "final"))
            if raw is None:
                joined = self._join(k, deadline)
                if joined is not None:
                    rank, world = joined
                    self._admitted(k, rank, world)
                    return rank, world, k
                raw = kv.get(keys.r(k, "final"))
                assert raw is not None
            final = self._final(raw, k)
            spare = final.world_size >= self._config.max_nodes
            if final.closed:
                self._raise_closed(spare)
            kv.add(keys.r(k, "late"), 1)
            self._wait_open(k, deadline, spare)
            k = self._find_round(kv, k + 1)

    def _find_round(self, kv: KeyValueStore, start: int) -> int:
        """The newest opened round at or after ``start`` (scanning forward from the hint)."""
        hint = parse_int(kv.get(self._keys.latest), self._keys.latest, default=0)
        k = max(start, hint)
        while True:
            current, nxt = kv.multi_get([self._keys.r(k, "open"), self._keys.r(k + 1, "open")])
            if current == CLOSED or nxt == CLOSED:
                self._raise_closed(False)
            if nxt is None:
                return k
            k += 1

    def _open(self, kv: KeyValueStore, k: int) -> None:
        value = kv.set_if_absent(self._keys.r(k, "open"), self._node.encode())
        if value == CLOSED:
            self._raise_closed(False)
        if value == self._node.encode():
            kv.set(self._keys.latest, str(k).encode())

    def _join(self, k: int, deadline: float) -> tuple[int, int] | None:
        """Take a slot in round ``k`` and wait for it to finish; ``None`` if not admitted."""
        kv, keys, cfg = self._kv, self._keys, self._config
        index = kv.enroll(keys.r(k, "joined"), self._node) - 1
        self._start_heartbeats()
        with self._lock:
            prev_round, prev_rank = self._round, self._rank
        slot = Slot(index, self._node, self._addr, prev_round, prev_rank)
        kv.set(keys.r(k, "slot/" + str(index)), slot.encode())
        count = index + 1
        if count >= cfg.max_nodes or (count >= cfg.min_nodes and count >= self._expected(kv, k)):
            self._finalise(kv, k, deadline)
        elif count >= cfg.min_nodes:
            self._bg.call_at(
                time.monotonic() + cfg.last_call_timeout.total_seconds(),
                lambda bg_kv: self._finalise(bg_kv, k, deadline),
            )
        timeout = timedelta(seconds=max(0.0, deadline - time.monotonic()))
        if not kv.wait([keys.r(k, "final")], timeout):
            kv.set(keys.r(k, "slot/" + str(index)), LEFT)
            raise RendezvousTimeoutError(
                f"The rendezvous '{cfg.run_id}' did not complete within "
                f"{cfg.join_timeout.total_seconds():g} s (round {k}, {count} node(s) joined "
                f"when this node arrived, min_nodes={cfg.min_nodes})."
            )
        raw = kv.get(keys.r(k, "final"))
        assert raw is not None
        final = self._final(raw, k)
        if final.closed:
            self._raise_closed(False)
        if index >= final.n:
            return None
        rank = parse_int(kv.get(keys.r(k, f"rank/{index}")), f"rank/{index}", default=-1)
        if rank < 0:
            return None
        if rank >= final.world_size:
            raise RendezvousStateError(
                f"Round {k} of '{cfg.run_id}' gave rank {rank} in a world of {final.world_size}."
            )
        return rank, final.world_size

    def _expected(self, kv: KeyValueStore, k: int) -> int:
        """How many nodes round ``k`` can expect: the last round's members, + late - dead."""
        if k == 0:
            return self._config.max_nodes
        keys = self._keys
        raw, late, dead = kv.multi_get(
            [keys.r(k - 1, "final"), keys.r(k - 1, "late"), keys.r(k - 1, "dead")]
        )
        if raw is None:
            return self._config.max_nodes
        final = self._final(raw, k - 1)
        expected = final.world_size + parse_int(late, "late") - parse_int(dead, "dead")
        return min(self._config.max_nodes, max(self._config.min_nodes, expected))

    def _finalise(
        self, kv: KeyValueStore, k: int, deadline: float, slot_wait: timedelta | None = None
    ) -> None:
        """Complete round ``k`` if nobody else has claimed it: one reader, one writer. Too
        few slots written (a node slow to write its own, or gone): look again each
        ``keep_alive_interval`` until ``deadline`` (a full round has no last-call timer)."""
        keys = self._keys
        if kv.get(keys.r(k, "final")) is not None:
            return
        if kv.set_if_absent(keys.r(k, "claim"), self._node.encode()) != self._node.encode():
            return
        try:
            n = kv.enrolled(keys.r(k, "joined"))
            slot_keys = [keys.r(k, f"slot/{i}") for i in range(n)]
            # a node writes its slot right after its add
            kv.wait(slot_keys, _SLOT_WAIT if slot_wait is None else slot_wait)
            slots = [
                Slot.decode(i, raw, slot_keys[i])
                for i, raw in enumerate(kv.multi_get(slot_keys))
                if raw is not None
            ]
        except RendezvousStateError as exc:
            kv.set_if_absent(keys.r(k, "final"), corrupt_record(str(exc)))
            raise
        present = [s for s in slots if s is not None]
        if len(present) < self._config.min_nodes:
            kv.delete(keys.r(k, "claim"))
            again = time.monotonic() + self._config.keep_alive_interval.total_seconds()
            if again < deadline:
                self._bg.call_at(again, lambda bg_kv: self._finalise(bg_kv, k, deadline, _NOW))
            return
        ranks = assign_ranks(present, k, self._config.max_nodes)
        world = len(ranks)
        by_index = {s.index: s for s in present}
        items = [(keys.r(k, f"rank/{i}"), str(ranks.get(i, -1)).encode()) for i in range(n)]
        items += [(keys.r(k, f"member/{r}"), by_index[i].node.encode()) for i, r in ranks.items()]
        kv.multi_set(items)
        kv.set_if_absent(keys.r(k, "final"), Final(n=n, world_size=world).encode())
        if k >= 2:
            self._bg.call_at(time.monotonic(), lambda bg_kv: self._forget(bg_kv, k - 2))

    def _forget(self, kv: KeyValueStore, k: int) -> None:
        """Background: drop the per-node keys of round ``k`` (two rounds old) so a long
        elastic job does not grow the store by O(N) keys per round. ``open`` and ``final``
        stay: they are what a straggler's forward scan relies on."""
        keys = self._keys
        raw = kv.get(keys.r(k, "final"))
        if raw is None:
            return
        final = Final.decode(raw, keys.r(k, "final"))
        doomed = [keys.r(k, f"slot/{i}") for i in range(final.n)]
        doomed += [keys.r(k, f"rank/{i}") for i in range(final.n)]
        doomed += [keys.r(k, f"member/{r}") for r in range(final.world_size)]
        kv.delete_many(doomed)

    def _wait_open(self, k: int, deadline: float, spare: bool) -> None:
        """Block (late or spare) until round ``k + 1`` opens; watch round ``k``'s liveness."""
        cfg = self._config
        watch = self._bg.call_at(
            time.monotonic() + cfg.keep_alive_interval.total_seconds(),
            lambda bg_kv: self._open_if_all_dead(bg_kv, k),
            every=cfg.keep_alive_interval.total_seconds(),
        )
        try:
            key = self._keys.r(k + 1, "open")
            self._spare_round = k if spare else None  # RendezvousHandler.spare_round
            while True:
                left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
                if self._kv.wait([key], _SPARE_WAIT if spare else left):
                    break
                if not spare:
                    self._kv.add(self._keys.r(k, "late"), -1)  # stop asking for a restart
                    raise RendezvousTimeoutError(
                        f"The rendezvous '{cfg.run_id}' did not admit this node within "
                        f"{cfg.join_timeout.total_seconds():g} s: round {k} is complete and "
                        "its members have not re-rendezvoused."
                    )
        finally:
            self._spare_round = None
            self._bg.cancel(watch)
        if self._kv.get(key) == CLOSED:
            self._raise_closed(spare)

    def _open_if_all_dead(self, kv: KeyValueStore, k: int) -> None:
        """Background: if every member of round ``k`` stopped beating, open round k+1."""
        state = self._watch_state(kv, k, all_members=True)
        if state is None or not state.seen:
            return
        now = time.monotonic()
        limit = self._dead_after()
        if all(now - since > limit for _, since in state.seen.values()):
            logger.warning("every member of round %d is silent; opening round %d", k, k + 1)
            self._open(kv, k + 1)

    # ---------------------------------------------------------------- heartbeats

    def _dead_after(self) -> float:
        cfg = self._config
        return cfg.keep_alive_interval.total_seconds() * cfg.keep_alive_max_attempt

    def _admitted(self, k: int, rank: int, world: int) -> None:
        with self._lock:
            self._round, self._rank, self._world = k, rank, world
            self._watch.pop(False, None)
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        """Beat from the moment this node takes a slot, not only once admitted: a node
        slow to see its round complete (its watch on an etcd member that went silent) is
        alive, and the members admitted before it must not presume it dead."""
        with self._lock:
            start = self._heartbeat_task is None
            if start:
                self._heartbeat_task = -1  # claimed; the id follows
        if start:
            self._heartbeat_task = self._bg.call_at(
                time.monotonic(),
                self._heartbeat,
                every=self._config.keep_alive_interval.total_seconds(),
            )

    def _heartbeat(self, kv: KeyValueStore) -> None:
        kv.add(self._keys.hb(self._node), 1)
        with self._lock:
            k, rank, world = self._round, self._rank, self._world
        if k is None or rank is None or world < 2:
            return
        state = self._watch_state(kv, k, rank=rank, world=world)
        if state is None:
            return
        now, limit = time.monotonic(), self._dead_after()
        for node, (_, since) in state.seen.items():
            if now - since > limit and node not in state.marked:
                state.marked.add(node)
                mark = self._keys.r(k, f"dead/{node}")
                if kv.set_if_absent(mark, self._node.encode()) == self._node.encode():
                    logger.warning("node %s missed its heartbeats in round %d", node, k)
                    kv.add(self._keys.r(k, "dead"), 1)

    def _watch_state(
        self, kv: KeyValueStore, k: int, *, rank: int = 0, world: int = 0, all_members: bool = False
    ) -> Watch | None:
        """Refresh the heartbeat counters this node watches in round ``k``."""
        watch = self._watch.get(all_members)
        if watch is None or watch.round != k:
            if all_members:
                raw = kv.get(self._keys.r(k, "final"))
                if raw is None:
                    return None
                world = self._final(raw, k).world_size
                ranks = list(range(world))
            else:
                ranks = sorted({(rank + d) % world for d in (1, 2)} - {rank})
            names = kv.multi_get([self._keys.r(k, f"member/{r}") for r in ranks])
            watch = Watch(round=k, neighbours=[n.decode() for n in names if n is not None])
            self._watch[all_members] = watch
        values = kv.multi_get([self._keys.hb(n) for n in watch.neighbours])
        now = time.monotonic()
        interval = self._config.keep_alive_interval.total_seconds()
        if watch.read_at is not None and now - watch.read_at > 2 * interval:
            watch.forgive(now - watch.read_at - interval)
        watch.read_at = now
        for node, value in zip(watch.neighbours, values, strict=True):
            old = watch.seen.get(node)
            if old is None or old[0] != value:
                watch.seen[node] = (value, now)
        return watch

    # ---------------------------------------------------------------- helpers

    def _side(self) -> KeyValueStore:
        """The connection for queries that must not queue behind a blocked
        ``next_rendezvous`` (e.g. ``set_closed`` from a signal-handling thread)."""
        side = self._side_kv
        if side is None:
            side = self._side_kv = self._kv.clone()
        return side

    def _close_within_timeout(self) -> None:
        """:meth:`_close` bounded by ``close_timeout`` (torch's bound for ``set_closed`` and
        ``shutdown``): the store calls run in a helper thread, so a store that stopped
        answering cannot hold the caller for its own, longer, timeout."""
        failure: list[BaseException] = []
        done = threading.Event()

        def close() -> None:
            try:
                with self._errors():
                    self._close(self._side())
            except BaseException as exc:  # SystemExit too: handed to the caller's thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=close, name=f"rdzv-close-{self._node}", daemon=True).start()
        limit = self._config.close_timeout.total_seconds()
        if not done.wait(limit):
            raise RendezvousTimeoutError(
                f"The rendezvous '{self._config.run_id}' could not be closed within "
                f"close_timeout={limit:g} s: the store at {self._kv.endpoint} did not answer."
            )
        if failure:
            raise failure[0]

    def _close(self, kv: KeyValueStore) -> None:
        keys = self._keys
        kv.set(keys.closed, b"1")
        hint = parse_int(kv.get(keys.latest), keys.latest, default=0)
        k = hint
        while kv.get(keys.r(k + 1, "open")) not in (None, CLOSED):
            k += 1
        kv.set_if_absent(keys.r(k, "final"), CLOSED)
        kv.set_if_absent(keys.r(k + 1, "open"), CLOSED)
        logger.info("node %s closed the rendezvous %r", self._node, self._config.run_id)

    def _bootstrap(self, rank: int, store: Store) -> RendezvousStoreInfo:
        """Rank 0 publishes the workers' store address in this round's store."""
        port: int | None = None
        if self.use_agent_store and rank == 0:
            if self._agent_server is None:
                from rallypoint._core.torch_c import TCPStore

                self._agent_server = TCPStore(
                    self._addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True
                )
            port = self._agent_server.port
        elif rank != 0:
            self._agent_server = None
        return RendezvousStoreInfo.build(rank, store, self._addr, server_port=port)

    def _final(self, raw: bytes, k: int) -> Final:
        final = Final.decode(raw, self._keys.r(k, "final"))
        if final.corrupt:
            raise RendezvousStateError(final.corrupt)
        return final

    def _raise_closed(self, spare: bool) -> None:
        message = f"The rendezvous '{self._config.run_id}' is closed."
        if spare:
            raise RendezvousGracefulExitError(message + " This node was a spare; exiting.")
        raise RendezvousClosedError(message)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Translate store errors at the boundary."""
        try:
            yield
        except KVConnectionError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        except KVStateError as exc:
            raise RendezvousStateError(str(exc)) from exc
