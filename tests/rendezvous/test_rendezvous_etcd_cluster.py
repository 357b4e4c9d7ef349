"""The dynamic rendezvous on a real 3-member etcd cluster: the leader killed (SIGKILL) or
frozen (SIGSTOP: silent, its connections held open, as behind a cut link) while nodes join,
and while they beat their hearts. Nodes are threads (each handler is a node)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rallypoint.rendezvous import (
    DynamicRendezvousHandler,
    RendezvousParameters,
    get_rendezvous_handler,
)
from rallypoint.testing._etcd import etcd_binary
from rallypoint.testing._etcd_cluster import EtcdCluster

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not on PATH (apt: etcd-server)"),
]

_ids = itertools.count()
# a liveness window (0.5 s x 10 = 5 s) longer than an election here (about 0.5 s) plus one
# bounded try at a silent member (request_timeout, 2 s), but shorter than etcd's own
# request timeout (6 s with a 500 ms election timeout) that a write to a follower waits
# when its proposal died with the leader
INTERVAL, ATTEMPTS = 0.5, 10
CONF = {
    "keep_alive_interval": str(INTERVAL),
    "keep_alive_max_attempt": str(ATTEMPTS),
    "read_timeout": "30",
    "join_timeout": "40",
    "use_agent_store": "false",
    "local_addr": "127.0.0.1",
}


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def _nodes(
    cluster: EtcdCluster, n: int, *, first: int = 0, **conf: Any
) -> list[DynamicRendezvousHandler]:
    """``n`` nodes of one job (every round needs all of them); their endpoint list starts
    with member ``first``, so that is the member they talk to."""
    prefix = f"/ha{next(_ids)}/"
    members = cluster.members[first:] + cluster.members[:first]
    endpoint = ",".join(m.endpoint for m in members)
    handlers = []
    for _ in range(n):
        params = RendezvousParameters(
            "etcd", endpoint, "job", n, n, key_prefix=prefix, **{**CONF, **conf}
        )
        handler = get_rendezvous_handler(params)
        assert isinstance(handler, DynamicRendezvousHandler)
        handlers.append(handler)
    return handlers


def _stop(handlers: list[DynamicRendezvousHandler]) -> None:
    for h in handlers:
        h._bg.stop()


def _wait_joined(cluster: EtcdCluster, handler: DynamicRendezvousHandler, k: int, n: int) -> None:
    """Until ``n`` nodes enrolled in round ``k`` (read through a fresh client)."""
    kv = handler._kv.clone()
    deadline = time.monotonic() + 20
    while kv.enrolled(handler._keys.r(k, "joined")) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _nobody_presumed_dead_then_next_round(
    handlers: list[DynamicRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    """After a member loss: let the liveness window pass; nobody was presumed dead, and
    the next round forms with everyone on the members left."""
    time.sleep(INTERVAL * ATTEMPTS + 2)
    assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
    assert [h.num_nodes_dead() for h in handlers] == [0, 0, 0]
    again = list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=40))
    assert sorted(i.rank for i in again) == [0, 1, 2]
    assert {h.round for h in handlers} == {1}


@pytest.mark.timeout(90)
def test_leader_killed_while_nodes_join_and_while_they_beat(cluster: EtcdCluster) -> None:
    handlers = _nodes(cluster, 3)
    pool = ThreadPoolExecutor(3)
    try:
        early = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
        _wait_joined(cluster, handlers[0], 0, 2)  # two wait in their watch, the round is open
        killed = cluster.kill_leader()
        late = pool.submit(handlers[2].next_rendezvous)
        infos = [f.result(40) for f in [*early, late]]
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        assert {i.world_size for i in infos} == {3}
        cluster.start_member(killed)
        cluster.wait_ready(require_all=True)

        # admitted: heartbeats run; kill the (new) leader
        cluster.kill_leader()
        _nobody_presumed_dead_then_next_round(handlers, pool)
    finally:
        _stop(handlers)
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(90)
def test_leader_frozen_while_nodes_join_and_while_they_beat(cluster: EtcdCluster) -> None:
    """The members the nodes talk to stop answering (no reset, no "no leader"): every wait
    and write moves to another member within one bounded try, nobody is presumed dead."""
    leader = cluster.leader()
    handlers = _nodes(cluster, 3, first=leader)  # they all talk to the leader
    pool = ThreadPoolExecutor(3)
    try:
        early = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
        _wait_joined(cluster, handlers[0], 0, 2)  # two watch `final` on the leader
        cluster.freeze(leader)
        frozen_at = time.monotonic()
        late = pool.submit(handlers[2].next_rendezvous)
        infos = [f.result(40) for f in [*early, late]]
        took = time.monotonic() - frozen_at
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        # an election (0.5 s), a watch slice (3 s), a try at the frozen member (2 s) and a
        # re-read elsewhere; not the 30-60 s of a socket timeout (measured: about 4 s)
        assert took < 15, took
        cluster.kill(leader)
        cluster.start_member(leader)
        cluster.wait_ready(require_all=True)

        # admitted and beating: freeze the leader again (followers forward writes to it)
        cluster.freeze(cluster.leader())
        _nobody_presumed_dead_then_next_round(handlers, pool)
    finally:
        _stop(handlers)
        pool.shutdown(wait=False, cancel_futures=True)


def test_cluster_bad_input() -> None:
    with pytest.raises(ValueError, match="size must be at least 1"):
        EtcdCluster(0)
    with pytest.raises(ValueError, match="at least 5 times"):
        EtcdCluster(3, election_timeout_ms=100, heartbeat_interval_ms=50)
    with pytest.raises(TypeError):
        EtcdCluster("3")  # type: ignore[arg-type]


def test_a_cut_needs_fake_hosts(cluster: EtcdCluster) -> None:
    assert cluster.endpoint == ",".join(f"127.0.0.1:{m.client_port}" for m in cluster.members)
    with pytest.raises(ValueError, match="fake hosts"):
        cluster.cut(0)
    leader = cluster.leader()
    other = (leader + 1) % 3
    cluster.move_leader(other)
    assert cluster.leader() == other
