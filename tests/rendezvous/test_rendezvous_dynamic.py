"""The dynamic handler: rounds, last call, timeouts, waiting list, spares, close, heartbeats,
stable ranks, per-round stores and corrupt state. Nodes are threads (each handler is a node)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.rendezvous import (
    DynamicRendezvousConfig,
    DynamicRendezvousHandler,
    KeyValueStore,
    MemoryKV,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
    _dynamic,
)
from rallypoint.rendezvous._kv_c10d import tcp_kv
from rallypoint.rendezvous._rounds import Slot, assign_ranks

FAST = {
    "last_call_timeout": timedelta(seconds=0.3),
    "keep_alive_interval": timedelta(seconds=0.1),
    "keep_alive_max_attempt": 3,
    "join_timeout": timedelta(seconds=20),
    "local_addr": "127.0.0.1",
    "use_agent_store": False,
}


class Cluster:
    """Handlers (nodes) over one store, run from a thread pool."""

    def __init__(self, make_kv: Callable[[], KeyValueStore], **config: Any) -> None:
        self.make_kv = make_kv
        self.config = {**FAST, "run_id": "job", **config}
        self.handlers: list[DynamicRendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=64)

    def node(self, **overrides: Any) -> DynamicRendezvousHandler:
        cfg = DynamicRendezvousConfig(**{**self.config, **overrides})
        handler = DynamicRendezvousHandler(self.make_kv(), cfg)
        self.handlers.append(handler)
        return handler

    def join(self, handler: DynamicRendezvousHandler) -> Future[RendezvousInfo]:
        return self.pool.submit(handler.next_rendezvous)

    def join_all(self, handlers: list[DynamicRendezvousHandler]) -> list[tuple[int, int]]:
        futures = [self.join(h) for h in handlers]
        return [(f.result(30).rank, f.result(30).world_size) for f in futures]

    def close(self) -> None:
        for h in self.handlers:
            h._bg.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def memory() -> Iterator[Cluster]:
    kv = MemoryKV()
    cluster = Cluster(lambda: kv)
    yield cluster
    kv.set("rallypoint/rdzv/job/closed", b"1")  # wake anything still blocked
    cluster.close()


@pytest.fixture(scope="module")
def tcp_port() -> Iterator[int]:
    kv, server = tcp_kv("127.0.0.1", 0, is_server=True, timeout=timedelta(seconds=30))
    yield int(kv.endpoint.rsplit(":", 1)[1])
    del server


@pytest.fixture
def tcp(tcp_port: int, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    def make() -> KeyValueStore:
        return tcp_kv("127.0.0.1", tcp_port, is_server=False, timeout=timedelta(seconds=30))[0]

    cluster = Cluster(make, run_id=f"job-{request.node.name}")
    yield cluster
    cluster.close()


def test_max_nodes_completes_at_once_with_unique_ranks(tcp: Cluster) -> None:
    nodes = [tcp.node(min_nodes=2, max_nodes=16, last_call_timeout=timedelta(seconds=60))]
    nodes += [tcp.node(min_nodes=2, max_nodes=16, last_call_timeout=timedelta(seconds=60))
              for _ in range(15)]  # fmt: skip
    start = time.monotonic()
    results = tcp.join_all(nodes)
    assert time.monotonic() - start < 30  # not the 60 s last call (a loaded machine)
    assert sorted(r for r, _ in results) == list(range(16))
    assert {w for _, w in results} == {16}
    assert all(h.round == 0 for h in nodes)


def test_last_call_after_min_nodes(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=4), memory.node(min_nodes=2, max_nodes=4)
    start = time.monotonic()
    results = memory.join_all([a, b])
    elapsed = time.monotonic() - start
    assert sorted(results) == [(0, 2), (1, 2)]
    assert 0.25 <= elapsed < 30  # the 0.3 s last call, not the join timeout


def test_join_timeout_when_too_few_nodes(memory: Cluster) -> None:
    lone = memory.node(min_nodes=2, max_nodes=2, join_timeout=timedelta(seconds=0.4))
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"did not complete within 0\.4 s"):
        lone.next_rendezvous()
    assert time.monotonic() - start < 30  # its 0.4 s, and no hang


def test_unpacks_as_store_rank_world_size(memory: Cluster) -> None:
    node = memory.node(min_nodes=1, max_nodes=1)
    store, rank, world_size = node.next_rendezvous()
    assert (rank, world_size) == (0, 1)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_waiting_list_then_scale_up_keeps_ranks(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=3), memory.node(min_nodes=2, max_nodes=3)
    first = dict(zip((a, b), memory.join_all([a, b]), strict=True))
    assert a.num_nodes_waiting() == 0
    late = memory.node(min_nodes=2, max_nodes=3)
    late_future = memory.join(late)
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.num_nodes_waiting() == 1
    assert b.num_nodes_waiting() == 1
    assert not late_future.done()
    # the agents re-rendezvous: all three are back, so the round completes at once
    second = memory.join_all([a, b])
    info = late_future.result(10)
    assert (info.rank, info.world_size) == (2, 3)
    assert second[0] == (first[a][0], 3) and second[1] == (first[b][0], 3)
    assert a.round == b.round == late.round == 1
    assert a.num_nodes_waiting() == 0


def test_spares_beyond_max_are_not_waiting_and_exit_on_close(memory: Cluster) -> None:
    nodes = [memory.node(min_nodes=2, max_nodes=2) for _ in range(2)]
    memory.join_all(nodes)
    spare = memory.node(min_nodes=2, max_nodes=2)
    spare_future = memory.join(spare)
    time.sleep(0.3)
    assert not spare_future.done()
    assert nodes[0].num_nodes_waiting() == 0  # spares do not ask for a restart
    nodes[0].set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        spare_future.result(10)


def test_spare_replaces_a_dead_node(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=2), memory.node(min_nodes=2, max_nodes=2)
    memory.join_all([a, b])
    spare = memory.node(min_nodes=2, max_nodes=2)
    spare_future = memory.join(spare)
    b._bg.stop()  # b dies: no more heartbeats
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.num_nodes_dead() == 1
    (result,) = memory.join_all([a])
    assert result == (0, 2)  # a keeps rank 0; the spare takes the dead node's rank
    assert spare_future.result(10).world_size == 2


def test_spare_round_says_which_round_a_spare_waits_out(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=2), memory.node(min_nodes=2, max_nodes=2)
    memory.join_all([a, b])
    spare = memory.node(min_nodes=2, max_nodes=2)
    assert spare.spare_round is None and a.spare_round is None
    spare_future = memory.join(spare)
    deadline = time.monotonic() + 10
    while spare.spare_round is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spare.spare_round == 0  # round 0 was full: it waits for round 1
    assert a.spare_round is None and b.spare_round is None
    b._bg.stop()
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    memory.join_all([a])
    assert spare_future.result(10).world_size == 2
    assert spare.spare_round is None  # admitted: no longer a spare


def test_dead_node_detected_and_survivors_keep_ranks(memory: Cluster) -> None:
    # a 90 s last call, so that "no last call" stands out from a slow host (4 of 4 nodes
    # first: a full round completes at once)
    last_call = timedelta(seconds=90)
    nodes = [memory.node(min_nodes=2, max_nodes=4, last_call_timeout=last_call) for _ in range(4)]
    ranks = dict(zip(nodes, (r for r, _ in memory.join_all(nodes)), strict=True))
    victim = next(h for h in nodes if ranks[h] == 1)
    victim._bg.stop()
    survivors = [h for h in nodes if h is not victim]
    deadline = time.monotonic() + 10
    while survivors[0].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(h.num_nodes_waiting() >= 1 for h in survivors)
    start = time.monotonic()
    again = dict(zip(survivors, memory.join_all(survivors), strict=True))
    assert time.monotonic() - start < 45  # everyone expected is back: no 90 s last call
    assert {w for _, w in again.values()} == {3}
    for h in survivors:
        if ranks[h] < 3:
            assert again[h][0] == ranks[h]  # survivors keep their rank where it fits
    assert sorted(r for r, _ in again.values()) == [0, 1, 2]


def test_set_closed_wakes_waiters_and_rejects_joins(memory: Cluster) -> None:
    waiting = memory.node(min_nodes=3, max_nodes=3)
    future = memory.join(waiting)
    time.sleep(0.1)
    closer = memory.node(min_nodes=3, max_nodes=3)
    assert not closer.is_closed()
    closer.set_closed()
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        future.result(10)
    assert waiting.is_closed()
    with pytest.raises(RendezvousClosedError):
        memory.node(min_nodes=3, max_nodes=3).next_rendezvous()


def test_shutdown_closes_like_torch(memory: Cluster) -> None:
    node = memory.node(min_nodes=1, max_nodes=1)
    node.next_rendezvous()
    assert node.shutdown() is True
    assert node.is_closed()


class SilentKV(MemoryKV):
    """A store that stops answering: once ``silent`` is set, every write blocks for up to
    ``hang`` seconds (a TCPStore or etcd whose host vanished, before its own timeout)."""

    def __init__(self, hang: float) -> None:
        super().__init__()
        self.silent = threading.Event()
        self.hang = hang
        self.released = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        if self.silent.is_set():
            self.released.wait(self.hang)
        super().set(key, value)


@pytest.mark.timeout(150)
def test_close_timeout_bounds_set_closed_and_shutdown() -> None:
    kv = SilentKV(hang=60)
    config = DynamicRendezvousConfig(
        run_id="job", min_nodes=1, max_nodes=1, **{**FAST, "close_timeout": timedelta(seconds=0.5)}
    )
    node = DynamicRendezvousHandler(kv, config)
    node.next_rendezvous()
    kv.silent.set()
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match=r"close_timeout=0\.5 s.*memory"):
            node.set_closed()
        assert time.monotonic() - start < 20  # not the store's 60 s (a loaded machine)
        start = time.monotonic()
        assert node.shutdown() is False  # torch's shutdown also reports a failed close
        assert time.monotonic() - start < 30  # close_timeout + stopping the heartbeats
    finally:
        kv.released.set()
    deadline = time.monotonic() + 10
    while not node.is_closed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.is_closed()  # the close went on once the store answered again


def test_close_timeout_comes_from_parameters() -> None:
    params = RendezvousParameters("c10d", "", "r", 1, 1, close_timeout="0.25")
    assert DynamicRendezvousConfig.from_parameters(params).close_timeout == timedelta(seconds=0.25)
    with pytest.raises(ValueError, match="'close_timeout'"):
        DynamicRendezvousConfig.from_parameters(
            RendezvousParameters("c10d", "", "r", 1, 1, close_timeout="0")
        )


def test_each_round_has_its_own_store(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=2), memory.node(min_nodes=2, max_nodes=2)
    f1, f2 = memory.join(a), memory.join(b)
    s1 = f1.result(10).store
    f2.result(10)
    s1.set("stale-address", b"1234")
    f1, f2 = memory.join(a), memory.join(b)
    s2 = f1.result(10).store
    f2.result(10)
    assert s2.check(["stale-address"]) is False  # a new round never reads old keys
    assert s1.get("stale-address") == b"1234"


def test_bootstrap_store_info_hosted_by_rank0(tcp: Cluster) -> None:
    nodes = [tcp.node(min_nodes=2, max_nodes=2, use_agent_store=True) for _ in range(2)]
    infos = [f.result(20) for f in [tcp.join(h) for h in nodes]]
    addresses = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                 for i in infos if i.bootstrap_store_info}  # fmt: skip
    assert len(addresses) == 1
    ((addr, port),) = addresses
    from torch.distributed import TCPStore

    client = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
    client.set("x", b"1")  # the workers' store is really there
    assert all(h.use_agent_store for h in nodes)


def test_corrupt_final_is_state_error(memory: Cluster) -> None:
    memory.make_kv().set("rallypoint/rdzv/job/r0/final", b"\x00garbage")
    with pytest.raises(RendezvousStateError, match="r0/final is corrupt"):
        memory.node(min_nodes=1, max_nodes=1).next_rendezvous()


def test_corrupt_latest_is_state_error(memory: Cluster) -> None:
    memory.make_kv().set("rallypoint/rdzv/job/latest", b"seven")
    with pytest.raises(RendezvousStateError, match="latest is corrupt"):
        memory.node(min_nodes=1, max_nodes=1).next_rendezvous()


def test_corrupt_counter_on_tcpstore_is_state_error_fast(tcp: Cluster) -> None:
    run = tcp.config["run_id"]
    tcp.make_kv().set(f"rallypoint/rdzv/{run}/r0/joined", b"garbage")
    start = time.monotonic()
    with pytest.raises(RendezvousStateError, match="not an integer"):
        tcp.node(min_nodes=1, max_nodes=1).next_rendezvous()
    assert time.monotonic() - start < 30  # at once, not after retries until a timeout


def test_corrupt_slot_fails_every_waiter(memory: Cluster) -> None:
    a = memory.node(min_nodes=2, max_nodes=2)
    future = memory.join(a)
    time.sleep(0.1)
    kv = memory.make_kv()
    kv.add("rallypoint/rdzv/job/r0/joined", 1)
    kv.set("rallypoint/rdzv/job/r0/slot/1", b"{not json")
    b = memory.node(min_nodes=2, max_nodes=3)
    with pytest.raises(RendezvousStateError):
        b.next_rendezvous()
    with pytest.raises(RendezvousStateError):
        future.result(10)


def test_store_failure_is_connection_error(memory: Cluster) -> None:
    kv = MemoryKV()
    node = DynamicRendezvousHandler(
        kv, DynamicRendezvousConfig(run_id="x", min_nodes=1, max_nodes=1, **FAST)
    )
    kv.fail_after(2)
    with pytest.raises(RendezvousConnectionError, match="memory"):
        node.next_rendezvous()
    node._bg.stop()


def test_many_nodes_in_one_process(memory: Cluster) -> None:
    nodes = [memory.node(min_nodes=64, max_nodes=64) for _ in range(64)]
    results = memory.join_all(nodes)
    assert sorted(r for r, _ in results) == list(range(64))
    assert len({h.node_id for h in nodes}) == 64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run_id": ""}, "run id must be a non-empty"),
        ({"run_id": "a/b"}, "must not contain '/'"),
        ({"min_nodes": 0}, r"minimum number of nodes \(0\)"),
        ({"min_nodes": 3, "max_nodes": 2}, r"maximum number of nodes \(2\)"),
        ({"join_timeout": timedelta(0)}, "join timeout"),
        ({"last_call_timeout": timedelta(seconds=-1)}, "last_call timeout"),
        ({"keep_alive_max_attempt": 0}, "keep_alive_max_attempt"),
        ({"keep_alive_interval": timedelta(0)}, "keep_alive_interval"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"run_id": "r", "min_nodes": 1, "max_nodes": 2}
    with pytest.raises(ValueError, match=message):
        DynamicRendezvousConfig(**{**base, **kwargs})


def test_config_rejects_seconds_as_numbers() -> None:
    with pytest.raises(TypeError, match="timedelta"):
        DynamicRendezvousConfig(run_id="r", min_nodes=1, max_nodes=1, join_timeout=5)  # type: ignore[arg-type]


def _slot(i: int, prev: int | None, round_: int | None = 0) -> Slot:
    return Slot(i, f"n{i}", "h", None if prev is None else round_, prev)


def test_assign_ranks_keeps_survivors_and_fills_holes() -> None:
    slots = [_slot(0, None), _slot(1, 2), _slot(2, 0), _slot(3, 5)]
    ranks = assign_ranks(slots, 1, max_nodes=8)
    assert ranks[2] == 0 and ranks[1] == 2  # kept
    assert sorted(ranks.values()) == [0, 1, 2, 3]
    assert ranks[3] == 1  # old rank 5 does not fit: first free rank, before newcomers
    assert ranks[0] == 3


def test_assign_ranks_prefers_previous_members_over_max() -> None:
    slots = [_slot(0, None), _slot(1, None), _slot(2, 0), _slot(3, 1)]
    ranks = assign_ranks(slots, 1, max_nodes=3)
    assert set(ranks) == {2, 3, 0}
    assert ranks[2] == 0 and ranks[3] == 1 and ranks[0] == 2


def test_assign_ranks_ignores_stale_rounds() -> None:
    slots = [_slot(0, 1, round_=3), _slot(1, 0, round_=3)]
    assert assign_ranks(slots, 9, max_nodes=2) == {0: 0, 1: 1}


def test_two_runs_share_a_store_without_interference(memory: Cluster) -> None:
    a = memory.node(min_nodes=1, max_nodes=1, run_id="one")
    b = memory.node(min_nodes=1, max_nodes=1, run_id="two")
    assert memory.join(a).result(10).world_size == 1
    assert memory.join(b).result(10).world_size == 1
    a.set_closed()
    assert not b.is_closed()


def test_background_thread_survives_store_errors(memory: Cluster) -> None:
    kv = MemoryKV()
    node = DynamicRendezvousHandler(
        kv, DynamicRendezvousConfig(run_id="bg", min_nodes=1, max_nodes=1, **FAST)
    )
    node.next_rendezvous()
    kv.fail_after(0)
    time.sleep(0.3)  # heartbeats fail and are logged
    kv.fail_after(None)
    before = kv.get("rallypoint/rdzv/bg/hb/" + node.node_id)
    deadline = time.monotonic() + 10  # a heartbeat every 0.1 s, once the store answers again
    while kv.get("rallypoint/rdzv/bg/hb/" + node.node_id) == before:
        assert time.monotonic() < deadline, "no heartbeat after the store recovered"
        time.sleep(0.05)
    node._bg.stop()
    assert threading.active_count() < 200


def test_old_rounds_are_forgotten(memory: Cluster) -> None:
    nodes = [memory.node(min_nodes=2, max_nodes=2) for _ in range(2)]
    for _ in range(4):
        memory.join_all(nodes)
    kv = memory.make_kv()
    assert isinstance(kv, MemoryKV)
    deadline = time.monotonic() + 5
    stale = ["/r0/slot/", "/r1/slot/", "/r0/rank/", "/r0/member/"]
    while any(s in k for k in kv.snapshot() for s in stale) and time.monotonic() < deadline:
        time.sleep(0.02)
    keys = kv.snapshot()
    assert not [k for k in keys if any(s in k for s in stale)]
    assert "rallypoint/rdzv/job/r0/final" in keys and "rallypoint/rdzv/job/r1/open" in keys
    assert "rallypoint/rdzv/job/r3/slot/1" in keys


def test_set_closed_from_another_thread_while_blocked_on_tcpstore(tcp: Cluster) -> None:
    node = tcp.node(min_nodes=2, max_nodes=2)
    future = tcp.join(node)
    time.sleep(0.2)  # node's client is now inside a blocking TCPStore wait
    start = time.monotonic()
    assert node.is_closed() is False
    assert node.num_nodes_waiting() == 0
    node.set_closed()  # the same handler, from another thread: must not queue
    assert time.monotonic() - start < 10  # behind the wait: its round's 20 s join timeout
    with pytest.raises(RendezvousClosedError):
        future.result(10)


def test_waiting_node_that_gives_up_stops_asking_for_a_restart(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=3), memory.node(min_nodes=2, max_nodes=3)
    memory.join_all([a, b])
    impatient = memory.node(min_nodes=2, max_nodes=3, join_timeout=timedelta(seconds=0.5))
    with pytest.raises(RendezvousTimeoutError, match="did not admit this node"):
        impatient.next_rendezvous()
    assert a.num_nodes_waiting() == 0


@given(
    prev_ranks=st.lists(st.one_of(st.none(), st.integers(0, 40)), max_size=40),
    max_nodes=st.integers(1, 40),
)
def test_assign_ranks_properties(prev_ranks: list[int | None], max_nodes: int) -> None:
    seen: set[int] = set()
    slots = []
    for i, prev in enumerate(prev_ranks):  # previous ranks are unique within a round
        if prev is not None and prev in seen:
            prev = None
        if prev is not None:
            seen.add(prev)
        slots.append(_slot(i, prev, round_=4))
    ranks = assign_ranks(slots, 5, max_nodes)
    world = min(len(slots), max_nodes)
    assert sorted(ranks.values()) == list(range(world))  # a permutation of 0..W-1
    survivors = [s for s in slots if s.prev_rank is not None]
    admitted_survivors = [s for s in survivors if s.index in ranks]
    assert len(admitted_survivors) == min(len(survivors), max_nodes)  # survivors first
    for s in admitted_survivors:
        if s.prev_rank is not None and s.prev_rank < world:
            assert ranks[s.index] == s.prev_rank  # kept wherever it fits


def test_run_store_outlives_rounds_and_opens_its_own_connection(memory: Cluster) -> None:
    a, b = memory.node(min_nodes=2, max_nodes=2), memory.node(min_nodes=2, max_nodes=2)
    assert a.round is None
    memory.join_all([a, b])
    assert a.round == b.round == 0
    first, second = a.open_run_store("job/x"), b.open_run_store("job/x")
    first.set("k", b"v")
    assert second.get("k") == b"v"  # one namespace, two connections
    assert a.open_run_store("job/y").check(["k"]) is False
    assert a.liveness_window() == timedelta(seconds=0.1 * (3 + 2))


def test_static_handler_has_no_run_store_rounds_or_heartbeats() -> None:
    from rallypoint._core.net import free_port
    from rallypoint.rendezvous import RendezvousParameters, rendezvous_handler_registry

    params = RendezvousParameters(
        backend="static",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="s",
        min_nodes=1,
        max_nodes=1,
        rank=0,
    )
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert handler.round is None
        assert handler.open_run_store("job") is None
        assert handler.liveness_window() is None
    finally:
        handler.shutdown()


def test_round_completes_when_a_node_writes_its_slot_late(
    memory: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node that fills the round finalises it, waiting a while for every slot; a node
    # starved between taking its number and writing its slot (a loaded host) must not make
    # it give up: with the round full no timer would try again, and every node would wait
    # out join_timeout.
    monkeypatch.setattr(_dynamic, "_SLOT_WAIT", timedelta(seconds=0.2))
    kv = memory.make_kv()
    assert isinstance(kv, MemoryKV)
    real_set = MemoryKV.set
    first_slot = "rallypoint/rdzv/job/r0/slot/0"

    def slow_first_slot(self: MemoryKV, key: str, value: bytes) -> None:
        if key == first_slot:
            time.sleep(1.0)
        real_set(self, key, value)

    monkeypatch.setattr(MemoryKV, "set", slow_first_slot)
    nodes = [memory.node(min_nodes=3, max_nodes=3, join_timeout=timedelta(seconds=6))]
    first = memory.join(nodes[0])
    deadline = time.monotonic() + 5
    while kv.get(first_slot.replace("slot/0", "joined")) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    nodes += [
        memory.node(min_nodes=3, max_nodes=3, join_timeout=timedelta(seconds=6)) for _ in range(2)
    ]
    others = [memory.join(h) for h in nodes[1:]]
    infos = [f.result(10) for f in [first, *others]]
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
