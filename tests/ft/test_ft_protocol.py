"""The quorum protocol at scale and over time, and every record it reads as input.

A real lighthouse (a TCPStore it hosts, or a real etcd server) and members as threads
through torchft's public ``coordination.LighthouseClient`` or the manager's link. Counts,
not times: the store operations each member makes per round, and the keys the store holds
after 100 and after 1,000 rounds. Then each forged record and bad input, with its line.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import rallypoint.ft._quorum.client as client_module
from rallypoint._core.net import free_port
from rallypoint.ft._quorum.client import LighthouseLink, QuorumRefused, post
from rallypoint.ft._quorum.records import Ask, Quorum, Request
from rallypoint.ft.coordination import LighthouseClient, LighthouseServer
from rallypoint.rendezvous import KeyValueStore, connect_kv

T = timedelta(seconds=30)


class Counting:
    """A key-value store that counts the operations made through it (by name)."""

    def __init__(self, kv: KeyValueStore, counts: Counter[str]) -> None:
        self._kv, self.counts = kv, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._kv, name)
        if callable(attr) and name not in ("clone", "endpoint"):

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.counts[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr


class _CountingStore:
    """A torch store that counts the calls made to it (each is a round trip or more)."""

    def __init__(self, store: Any, counts: Counter[str]) -> None:
        self._store, self.counts = store, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return attr(*args, **kwargs)

        return counted


def _settled(count: Callable[[], int], bound: int, within: float = 15.0) -> int:
    """The store's key count once it is at most ``bound``, or after ``within`` seconds: the
    lighthouse's janitor deletes on a thread of its own, behind on a loaded machine."""
    deadline = time.monotonic() + within
    while (n := count()) > bound and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def _rounds(client: LighthouseClient, names: list[str], rounds: int, first: int = 0) -> None:
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            for step in range(first, first + rounds):
                client.quorum(name, T, step=step, world_size=1)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


@pytest.fixture
def house() -> Iterator[tuple[LighthouseServer, list[str]]]:
    lines: list[str] = []
    server = LighthouseServer("[::]:0", min_replicas=1, join_timeout_ms=2000, say=lines.append)
    yield server, lines
    server.shutdown()


@pytest.fixture
def make_house() -> Iterator[Callable[..., LighthouseServer]]:
    """Lighthouses shut down whatever the test ends with (a live one at exit aborts)."""
    made: list[LighthouseServer] = []

    def make(*args: Any, **kwargs: Any) -> LighthouseServer:
        made.append(LighthouseServer(*args, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.shutdown()


def _port(server: LighthouseServer) -> int:
    return int(server.address().rpartition(":")[2])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("members", [4, 16, 64])
def test_each_member_makes_the_same_few_store_operations_a_round_whatever_their_number(
    members: int, monkeypatch: pytest.MonkeyPatch, make_house: Callable[..., LighthouseServer]
) -> None:
    server = make_house("[::]:0", min_replicas=members, join_timeout_ms=60000)
    counts: dict[str, Counter[str]] = {}
    real = client_module.connect_lighthouse

    def counting(address: str, timeout: float) -> Any:
        name = threading.current_thread().name
        counts.setdefault(name, Counter())
        return Counting(real(address, timeout), counts[name])

    monkeypatch.setattr(client_module, "connect_lighthouse", counting)
    client = LighthouseClient(server.address(), timedelta(seconds=30))
    names = [f"g{i}" for i in range(members)]
    barrier = threading.Barrier(members)
    per_member: dict[str, int] = {}
    house: Counter[str] = Counter()  # the lighthouse's side connection: janitor, ticker
    side = server._side  # type: ignore[attr-defined]
    side._store = _CountingStore(side._store, house)

    def member(name: str) -> None:
        threading.current_thread().name = name
        client.quorum(name, T, step=0)  # joins; the link's connection is made here
        for step in range(1, 4):
            client.quorum(name, T, step=step)
        barrier.wait(60)
        before = sum(counts[name].values())
        for step in range(4, 24):
            client.quorum(name, T, step=step)
        per_member[name] = sum(counts[name].values()) - before

    threads = [threading.Thread(target=member, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert len(per_member) == members, "a member did not finish"
    # an ask is two appends (the inbox), then a wait on the next round and a get of it (one
    # member of each process reads it): four operations a round, the same at 4 members as
    # at 64 (O(G) in all)
    assert max(per_member.values()) <= 4 * 20, per_member
    # the janitor deletes a few keys a round (its record, its votes), not one per member's
    # ask: a member's answers are keys of their own only while it joins (two at most)
    assert house["delete_key"] <= 4 * server.loop.rounds + 2 * members, house
    client.close()
    server.shutdown()


@pytest.mark.timeout(60)
def test_the_lighthouse_reads_its_inbox_up_to_a_slot_not_written_in_few_round_trips() -> None:
    """64 slots counted, slot 40 not written yet (its writer is between its add and its
    set): the run up to it is found with a binary search of checks, not with a round trip
    per slot (at G members that made each wake of the lighthouse O(G))."""
    import torch.distributed as dist

    from rallypoint.ft._quorum.inbox import Inbox
    from rallypoint.rendezvous._kv_c10d import C10dKV

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = [f"in/{i}" for i in range(1, 65)]
    for key in keys:
        if key != "in/40":
            store.set(key, b"x")
    kv = C10dKV(store, endpoint=f"127.0.0.1:{store.port}")
    trips: Counter[str] = Counter()
    kv._store = _CountingStore(store, trips)  # type: ignore[assignment]
    inbox = SimpleNamespace(kv=kv)
    assert Inbox._written(inbox, keys) == keys[:39]  # type: ignore[arg-type]
    assert sum(trips.values()) <= 8, trips  # one check of all, then log2(64) = 6
    trips.clear()
    store.set("in/40", b"x")
    assert Inbox._written(inbox, keys) == keys  # type: ignore[arg-type]
    assert sum(trips.values()) == 1, trips


@pytest.mark.timeout(240)
def test_the_lighthouse_store_holds_as_many_keys_after_1000_rounds_as_after_100(
    make_house: Callable[..., LighthouseServer],
) -> None:
    server = make_house("[::]:0", min_replicas=4, join_timeout_ms=60000)
    store = server.loop.kv.store  # type: ignore[attr-defined]
    client = LighthouseClient(server.address(), timedelta(seconds=10))
    names = [f"g{i}" for i in range(4)]
    _rounds(client, names, 100)
    after_100 = store.num_keys()
    _rounds(client, names, 900, first=100)
    after_1000 = _settled(store.num_keys, after_100 + 12)
    assert server.loop.rounds >= 900  # (a first ask told to ask again shares a round)
    assert after_1000 <= after_100 + 12, (after_100, after_1000)  # ticks, the 8 news kept
    assert after_1000 <= 100 * len(names), after_1000
    client.close()
    server.shutdown()


@pytest.mark.timeout(240)
def test_on_etcd_the_keys_stay_flat_over_1000_rounds_and_history_is_compacted(
    tmp_path: Any,
) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("needs etcd (Debian's etcd-server)")
    from rallypoint.testing._etcd_cluster import EtcdCluster

    with EtcdCluster(1) as cluster:
        address = f"etcd://{cluster.members[0].endpoint}/flat"
        server = LighthouseServer(min_replicas=2, join_timeout_ms=60000, store=address)
        try:
            kv = server.loop.kv
            client = LighthouseClient(address, timedelta(seconds=10))
            names = ["a", "b"]
            _rounds(client, names, 100)
            after_100 = kv.count_prefix("")  # type: ignore[attr-defined]
            _rounds(client, names, 900, first=100)
            after_1000 = _settled(lambda: kv.count_prefix(""), after_100 + 12)  # type: ignore[attr-defined]
            assert after_1000 <= after_100 + 12, (after_100, after_1000)  # ticks, the 8 news kept
            kv.compact(keep=100)  # what the loop does once a minute
            client.close()
        finally:
            server.shutdown()


@pytest.mark.timeout(120)
def test_forged_records_are_named_in_one_line_and_the_members_go_on(
    house: tuple[LighthouseServer, list[str]],
) -> None:
    server, lines = house
    said: list[str] = []
    links = [
        LighthouseLink(
            server.address(), f"{g}:x", str(g), connect_timeout=10, heartbeat=0.05, say=said.append
        )
        for g in range(2)
    ]
    forger, _ = connect_kv(server.address(), timeout=T)

    def both(step: int, first_reads: str = "") -> None:
        """Both members ask; with ``first_reads``, the second only once the first said it
        (the round cannot be decided without the second's ask, so the first reads what
        the forger wrote before the lighthouse writes the round over it)."""
        out: list[Any] = []
        threads = [
            threading.Thread(target=lambda k=link: out.append(k.quorum(_req(k, step), 20)))
            for link in links
        ]
        threads[0].start()
        deadline = time.monotonic() + 15
        while first_reads and not any(first_reads in x for x in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.01)
        threads[1].start()
        for t in threads:
            t.join(30)
        assert len(out) == 2 and all(len(q.members) == 2 for q in out), out

    both(0)
    # inbox bytes that are not JSON (on no line of their own), and a message of an unknown kind
    forger.append("in/box", b"\x00garbage")
    forger.append("in/box", b'\n{"kind": "reboot"}\n')
    forger.append("in/bell", b".")
    # a heartbeat that is not a counter
    forger.set("hb/0:x", b"not a number")
    # the next round, which both members wait on, forged before it is decided
    forger.set("r/1", b"{not json")
    # a notice that a live member left
    post(forger, Ask("gone", "0:x", why="forged"))
    both(1, first_reads="r/1: not JSON")
    for step in range(2, 6):
        both(step)
    time.sleep(0.5)
    both(6)
    text = "\n".join(lines + said)
    assert "in/" in text and "not JSON" in text, text
    assert "unknown kind 'reboot'" in text, text
    assert "hb/0:x" in text, text
    assert "r/1: not JSON" in text, text
    back = "0:x asks again: it is back (it was said to have left: forged)"
    assert back in text or "a notice that 0:x left (forged) is not believed" in text, text
    for link in links:
        link.close("done")


def _req(link: LighthouseLink, step: int) -> Request:
    return Request(link.member, link.replica_id, step, 1)


@pytest.mark.timeout(120)
def test_a_second_group_with_a_live_groups_replica_id_is_refused_in_one_line() -> None:
    lines: list[str] = []
    server = LighthouseServer("[::]:0", 1, 100, 50, 3000, say=lines.append)
    try:
        first = LighthouseLink(server.address(), "7:a", "7", connect_timeout=10, heartbeat=0.05)
        first.quorum(Request("7:a", "7", 0, 1), 10)
        keep = threading.Event()

        def keep_asking() -> None:
            step = 1
            while not keep.is_set():
                first.quorum(Request("7:a", "7", step, 1), 30)
                step += 1

        threading.Thread(target=keep_asking, daemon=True).start()
        second = LighthouseLink(server.address(), "7:b", "7", connect_timeout=10, heartbeat=0.05)
        began = time.monotonic()
        with pytest.raises(QuorumRefused) as caught:
            second.quorum(Request("7:b", "7", 0, 1), 30)
        assert time.monotonic() - began < 20.0  # held one heartbeat timeout, then refused
        assert "replica id '7' is taken by a live replica group (7:a)" in str(caught.value)
        assert "REPLICA_GROUP_ID" in str(caught.value)
        keep.set()
        second.close()
        first.close("done")
    finally:
        server.shutdown()
    assert any(line.startswith("refused 7:b") for line in lines), lines


@pytest.mark.timeout(120)
def test_below_min_replicas_the_lighthouse_and_each_group_say_so_once() -> None:
    lines: list[str] = []
    server = LighthouseServer("[::]:0", min_replicas=3, join_timeout_ms=100, say=lines.append)
    said: list[list[str]] = [[], []]
    try:
        links = [
            LighthouseLink(
                server.address(), f"{g}:x", str(g), connect_timeout=10, say=said[g].append
            )
            for g in range(2)
        ]
        errors: list[BaseException] = []

        def ask(link: LighthouseLink) -> None:
            try:
                link.quorum(_req(link, 0), 2.0)
            except TimeoutError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(link,)) for link in links]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(errors) == 2, errors
        assert all("--min_replicas 3" in str(e) for e in errors), errors
        for link in links:
            link.close()
    finally:
        server.shutdown()
    below = [line for line in lines if "--min_replicas is 3" in line]
    assert len(below) == 1, lines  # once, though the count went from 1 to 2
    for g in range(2):  # each group said it, once, while it waited
        assert len([line for line in said[g] if "--min_replicas is 3" in line]) == 1, said


@pytest.mark.timeout(120)
def test_groups_starting_one_by_one_below_min_replicas_each_say_it_once() -> None:
    """12 groups join one at a time under ``--min_replicas 12``: the count changes 11
    times, yet the lighthouse says it once and each group at most once, then they all form
    the quorum."""
    lines: list[str] = []
    server = LighthouseServer("[::]:0", min_replicas=12, join_timeout_ms=100, say=lines.append)
    said: list[list[str]] = [[] for _ in range(12)]
    got: list[Quorum] = []
    try:
        links = []
        threads = []
        for g in range(12):
            link = LighthouseLink(
                server.address(), f"{g}:x", str(g), connect_timeout=10, say=said[g].append
            )
            links.append(link)
            threads.append(
                threading.Thread(target=lambda k=link: got.append(k.quorum(_req(k, 0), 60.0)))
            )
            threads[-1].start()
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        for link in links:
            link.close()
    finally:
        server.shutdown()
    assert len(got) == 12 and all(len(q.members) == 12 for q in got), got
    assert len([line for line in lines if "--min_replicas is 12" in line]) == 1, lines
    for g in range(12):
        assert len([line for line in said[g] if "--min_replicas is 12" in line]) <= 1, said[g]


@pytest.mark.timeout(60)
def test_a_heal_port_flooded_with_idle_connections_still_serves_its_group() -> None:
    import torch

    from rallypoint.ft._heal import MAX_CONNECTIONS, HealServer, fetch_state

    server = HealServer(b"key", timeout=10.0)
    server.allow(3, {"w": torch.ones(4)})
    flood = []
    for _ in range(3 * MAX_CONNECTIONS):
        try:
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=1))
        except OSError:
            break
    time.sleep(0.3)
    threads = sum(1 for t in threading.enumerate() if t.name.startswith("Thread"))
    assert threads <= MAX_CONNECTIONS + 8, threads
    for s in flood:
        s.close()
    deadline = time.monotonic() + 10
    while True:  # the flood's slots come free as its connections close
        try:
            state, size = fetch_state(f"127.0.0.1:{server.port}", b"key", 3, timeout=5.0)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert torch.equal(state["w"], torch.ones(4)) and size == 16
    server.close()


@pytest.mark.parametrize(
    "address, says",
    [
        ("garbage", "is not a lighthouse address"),
        ("http://", "is not a lighthouse address"),
        ("", "set TORCHFT_LIGHTHOUSE"),
    ],
)
def test_a_malformed_lighthouse_address_is_one_line_at_once(address: str, says: str) -> None:
    began = time.monotonic()
    with pytest.raises(ValueError) as caught:
        LighthouseClient(address, timedelta(seconds=5))
    assert says in str(caught.value)
    assert time.monotonic() - began < 1.0


def test_an_unreachable_lighthouse_is_one_line_within_the_connect_timeout() -> None:
    dead = free_port()
    began = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        LighthouseClient(f"http://127.0.0.1:{dead}", timedelta(seconds=1.5))
    assert time.monotonic() - began < 3.0
    assert "cannot reach the lighthouse" in str(caught.value) and "refused" in str(caught.value)
    leftover = [t.name for t in threading.enumerate() if "tcpstore-connect" in t.name]
    assert not leftover, leftover  # nothing left to wait for at exit
