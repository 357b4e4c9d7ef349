"""etcd v3 against a real etcd server: the KV contract, the handler, restarts, leases, auth."""

from __future__ import annotations

import gc
import itertools
import json
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rallypoint._core.net import free_port
from rallypoint.rendezvous import (
    DynamicRendezvousHandler,
    KeyValueStore,
    KVConnectionError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
    get_rendezvous_handler,
)
from rallypoint.rendezvous._etcd.gateway import EtcdGateway
from rallypoint.rendezvous._etcd.kv import EtcdKV, EtcdOptions
from rallypoint.testing._etcd import EtcdServer, etcd_binary, make_tls_files
from rallypoint.testing._rendezvous_contract import KVContract
from rallypoint.testing._workers import run_workers

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not on PATH (apt: etcd-server)"),
]

_ids = itertools.count()
FAST = {"last_call_timeout": "0.3", "keep_alive_interval": "0.2", "use_agent_store": "false"}


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def _kv(server: EtcdServer, **options: Any) -> EtcdKV:
    return EtcdKV(
        EtcdOptions(
            endpoints=[("127.0.0.1", server.client_port)],
            prefix=f"/test{next(_ids)}/",
            **options,
        )
    )


def _two_clients(etcd: EtcdServer) -> tuple[EtcdKV, EtcdKV]:
    """Two clients of the same keys (no lease): the one under test and another node."""
    kv, other = _kv(etcd, lease_ttl=0), _kv(etcd, lease_ttl=0)
    other._prefix = kv._prefix
    return kv, other


class TestEtcdKV(KVContract):
    @pytest.fixture
    def kv(self, etcd: EtcdServer) -> Iterator[KeyValueStore]:
        kv = _kv(etcd)
        yield kv
        kv.close()


def _params(server: EtcdServer, run_id: str, n: int, **options: Any) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd", server.endpoint, run_id, n, n, key_prefix=f"/rdzv{next(_ids)}/", **FAST, **options
    )


def test_handler_over_etcd(etcd: EtcdServer) -> None:
    prefix = f"/h{next(_ids)}/"
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters("etcd", etcd.endpoint, "job", 8, 8, key_prefix=prefix, **FAST)
        )
        for _ in range(8)
    ]
    with ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert sorted(i.rank for i in infos) == list(range(8))
    assert {i.world_size for i in infos} == {8}
    infos[0].store.set("k", b"v")
    assert infos[7].store.get("k") == b"v"
    handlers[0].set_closed()
    assert all(h.is_closed() for h in handlers)
    for h in handlers:
        assert isinstance(h, DynamicRendezvousHandler)
        h._bg.stop()


def _gloo_over_etcd(endpoint: str, prefix: str) -> float:
    import torch
    import torch.distributed as dist

    params = RendezvousParameters("etcd", endpoint, "gloo", 2, 2, key_prefix=prefix, **FAST)
    info = get_rendezvous_handler(params).next_rendezvous()
    dist.init_process_group("gloo", store=info.store, rank=info.rank, world_size=info.world_size)
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value.item())


@pytest.mark.timeout(60)
def test_gloo_process_group_over_the_etcd_store(etcd: EtcdServer) -> None:
    results = run_workers(_gloo_over_etcd, 2, etcd.endpoint, f"/g{next(_ids)}/", timeout=50)
    assert results == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_etcd_restart_mid_rendezvous() -> None:
    with EtcdServer() as server:
        params = [_params(server, "restart", 3, read_timeout="30") for _ in range(3)]
        prefix = params[0].config["key_prefix"]
        for p in params:
            p.config["key_prefix"] = prefix
        handlers = [get_rendezvous_handler(p) for p in params]
        with ThreadPoolExecutor(3) as pool:
            early = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
            time.sleep(0.5)  # two nodes are blocked in their watch
            server.stop()
            time.sleep(0.5)
            server.start()
            late = pool.submit(handlers[2].next_rendezvous)
            infos = [f.result(40) for f in [*early, late]]
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        for h in handlers:
            assert isinstance(h, DynamicRendezvousHandler)
            h._bg.stop()


def test_etcd_down_is_connection_error_naming_endpoint() -> None:
    port = free_port()
    params = RendezvousParameters(
        "etcd", f"127.0.0.1:{port}", "job", 1, 1, read_timeout="1", **FAST
    )
    handler = get_rendezvous_handler(params)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        handler.next_rendezvous()
    assert time.monotonic() - start < 10
    assert isinstance(handler, DynamicRendezvousHandler)
    handler._bg.stop()


def test_set_if_absent_racing_a_delete(etcd: EtcdServer) -> None:
    """One node keeps writing and deleting a key while another creates it if absent: the
    creator always learns the value that was stored, never a missing one."""
    kv, other = _two_clients(etcd)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            other.set("contended", b"theirs")
            other.delete("contended")

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        seen = {kv.set_if_absent("contended", b"mine") for _ in range(100)}
        for _ in range(50):
            kv.delete("contended")
            seen.add(kv.set_if_absent("contended", b"mine"))
    finally:
        stop.set()
        thread.join(10)
    assert seen <= {b"mine", b"theirs"}
    assert b"mine" in seen


def _after_each_read(kv: EtcdKV, then: Callable[[bytes, bytes | None], object]) -> None:
    """``then(key, value)`` after each of ``kv``'s reads: a write there is one made between
    a wait's read and its watch."""
    read = kv._range

    def reading(full: bytes) -> tuple[bytes | None, int]:
        found = read(full)
        then(full, found[0])
        return found

    kv._range = reading  # type: ignore[method-assign]


def _woken_after(kv: EtcdKV, other: EtcdKV, key: str, delay: float) -> float:
    """Seconds ``kv.wait`` on ``key`` takes when ``other`` writes it ``delay`` s in."""
    timer = threading.Timer(delay, other.set, (key, b"1"))
    timer.start()
    try:
        start = time.monotonic()
        assert kv.wait([key], timedelta(seconds=20))
        return time.monotonic() - start
    finally:
        timer.join(10)


@pytest.mark.timeout(60)
def test_a_put_made_while_a_wait_sets_up_its_watch_wakes_it_at_once(etcd: EtcdServer) -> None:
    """etcd hands a watch that starts behind its head (a write anywhere since the read) its
    history on a catch-up loop every 100 ms: such a wake came 0-100 ms late (a lighthouse
    round on etcd took 55-70 ms, most of it here). The put is found by a read once the
    watch is made, not by the watch: each wait reads its key twice, missing, then found,
    well before its timeout (where a last read finds it too). The time is not held to the
    catch-up's 50 ms: on a loaded machine a read can take as long."""
    kv, other = _two_clients(etcd)
    reads: dict[bytes, list[bytes | None]] = {}

    def write_it_once(full: bytes, value: bytes | None) -> None:
        reads.setdefault(full, []).append(value)
        if value is None and len(reads[full]) == 1:  # the key itself, once, after its read
            other.set(full.decode().rsplit("/", 1)[1], b"1")

    _after_each_read(kv, write_it_once)
    for i in range(11):
        start = time.monotonic()
        assert kv.wait([f"k{i}"], timedelta(seconds=5))
        assert time.monotonic() - start < 4, i
    assert len(reads) == 11, reads
    assert all(seen == [None, b"1"] for seen in reads.values()), reads


@pytest.mark.timeout(60)
def test_a_wait_whose_watch_starts_behind_the_head_still_sees_a_later_put(
    etcd: EtcdServer,
) -> None:
    """Another key written as the watch is made: the read finds the awaited one missing,
    and the watch must still deliver its put when it comes."""
    kv, other = _two_clients(etcd)
    written: list[bytes] = []

    def write_another_once(full: bytes, value: bytes | None) -> None:
        if value is None and not written:
            written.append(full)
            other.set("unrelated", b"1")

    _after_each_read(kv, write_another_once)
    assert 0.25 < _woken_after(kv, other, "late", 0.3) < 5


@pytest.mark.timeout(60)
def test_a_wait_on_a_store_written_without_pause_neither_spins_nor_misses_the_put(
    etcd: EtcdServer,
) -> None:
    """A store written between every read and the watch after it (a busy lighthouse's, a
    rendezvous of many nodes): a wait that watched from the revision it read would start
    every watch behind etcd's head, and one that gave those up would read without end.
    One read, one watch and one read once it is made; the put wakes it."""
    kv, other = _two_clients(etcd)
    reads: list[bytes | None] = []

    def write_another(full: bytes, value: bytes | None) -> None:
        reads.append(value)
        other.set(f"busy{len(reads)}", b"1")

    _after_each_read(kv, write_another)
    assert 1.4 < _woken_after(kv, other, "awaited", 1.5) < 10
    assert len(reads) <= 3, len(reads)


@pytest.mark.timeout(150)
def test_close_timeout_bounds_set_closed_against_a_silent_etcd() -> None:
    params = RendezvousParameters(
        "etcd", f"127.0.0.1:{free_port()}", "job", 1, 1,
        read_timeout="60", close_timeout="1", **FAST,
    )  # fmt: skip
    handler = get_rendezvous_handler(params)
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"close_timeout=1 s"):
        handler.set_closed()
    assert time.monotonic() - start < 20  # not read_timeout's 60 s (a loaded machine)
    start = time.monotonic()
    assert handler.shutdown() is False
    assert time.monotonic() - start < 30


def test_lease_expires_keys_of_a_dead_job(etcd: EtcdServer) -> None:
    kv = _kv(etcd, lease_ttl=2)
    kv.set("alive", b"1")
    other = EtcdKV(kv._opts)
    other.set("second", b"1")
    assert other._lease_id() == kv._lease_id()  # one lease per run, shared by its nodes
    time.sleep(2.5)
    assert kv.get("alive") == b"1"  # kept alive while a node lives
    kv.close()
    other.close()  # every node is gone: nobody renews the lease
    deadline = time.monotonic() + 10
    reader = EtcdKV(EtcdOptions(endpoints=kv._opts.endpoints, prefix=kv._opts.prefix, lease_ttl=0))
    while reader.get("alive") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reader.get("alive") is None
    assert reader.get("second") is None


def test_a_kv_dropped_without_close_stops_renewing_its_lease(etcd: EtcdServer) -> None:
    """Its keep-alive thread does not hold it: a handler dropped without ``shutdown()``
    does not keep its lease, and its keys, alive as long as the process."""
    kv = _kv(etcd, lease_ttl=2)  # renewed every 0.67 s
    kv.set("k", b"1")
    thread = kv._keepalive
    assert thread is not None and thread.is_alive()
    dropped = weakref.ref(kv)
    del kv
    gc.collect()
    assert dropped() is None
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_lease_found_gone_is_replaced(etcd: EtcdServer) -> None:
    """A keep-alive told "requested lease not found" (revoked, or expired while etcd was
    away) takes a new lease instead of renewing a dead one forever."""
    kv = _kv(etcd, lease_ttl=3)  # renewed every second
    kv.set("before", b"1")
    lease = kv._lease
    _post(etcd, "/v3/lease/revoke", {"ID": str(lease)})
    deadline = time.monotonic() + 10
    while kv._lease == lease:
        assert time.monotonic() < deadline, "the keep-alive kept the revoked lease"
        time.sleep(0.1)
    kv.set("after", b"1")
    assert kv.get("after") == b"1"
    assert kv.get("before") is None  # gone with its lease
    kv.close()


def _post(server: EtcdServer, path: str, body: dict[str, Any], token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.timeout(60)
def test_user_password_auth() -> None:
    with EtcdServer() as server:
        _post(server, "/v3/auth/user/add", {"name": "root", "password": "s3cret"})
        _post(server, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        _post(server, "/v3/auth/enable", {})
        good = _kv(server, username="root", password="s3cret", lease_ttl=0)
        good.set("k", b"v")
        assert good.get("k") == b"v"
        gateway = good._gateway
        assert isinstance(gateway, EtcdGateway)
        gateway._token = "expired-token"  # a stale token is renewed transparently
        assert good.get("k") == b"v"
        assert gateway.authentications == 2
        gateway._token = "expired-again"  # now eight threads find it stale at once
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda _: good.get("k"), range(8))) == [b"v"] * 8
        assert gateway.authentications == 3  # one new token for all of them
        with pytest.raises(KVConnectionError, match="rejected user 'root'"):
            _kv(server, username="root", password="wrong", lease_ttl=0).get("k")
        with pytest.raises((KVConnectionError, Exception)):
            _kv(server, lease_ttl=0, timeout=timedelta(seconds=1)).get("k")


@pytest.mark.parametrize(
    ("endpoint", "options", "message"),
    [
        ("", {}, "needs an endpoint"),
        ("127.0.0.1:abc", {}, "rendezvous endpoint"),
        ("127.0.0.1:2379", {"protocol": "gopher"}, "'protocol'"),
        ("127.0.0.1:2379", {"lease_ttl": "long"}, "'lease_ttl'"),
        ("127.0.0.1:2379", {"request_timeout": "soon"}, "'request_timeout'"),
        ("127.0.0.1:2379", {"request_timeout": "0"}, "'request_timeout' must be > 0"),
        ("127.0.0.1:2379", {"username": "u"}, "both 'username' and 'password'"),
        ("127.0.0.1:2379", {"cert": "c.pem"}, "both 'cert' and 'key'"),
    ],
)
def test_etcd_bad_input(endpoint: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_rendezvous_handler(RendezvousParameters("etcd", endpoint, "job", 1, 1, **options))


def test_endpoint_list_and_scheme(etcd: EtcdServer) -> None:
    dead = free_port()
    params = RendezvousParameters(
        "etcd-v3",
        f"http://127.0.0.1:{dead},http://{etcd.endpoint}",
        "multi",
        1,
        1,
        key_prefix=f"/m{next(_ids)}/",
        **FAST,
    )
    handler = get_rendezvous_handler(params)  # the first endpoint is down: fail over
    assert handler.get_backend() == "etcd-v3"
    assert handler.next_rendezvous().world_size == 1
    assert isinstance(handler, DynamicRendezvousHandler)
    handler._bg.stop()


@pytest.mark.timeout(90)
def test_tls_with_client_certificates(tmp_path: Path) -> None:
    try:
        tls = make_tls_files(str(tmp_path))
    except FileNotFoundError:
        pytest.skip("openssl is not on PATH")
    with EtcdServer(tls=tls) as server:
        options = {"cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key}
        params = RendezvousParameters(
            "etcd", f"https://{server.endpoint}", "tls", 2, 2, **options, **FAST
        )
        handlers = [get_rendezvous_handler(params) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert sorted(i.rank for i in infos) == [0, 1]
        for h in handlers:
            assert isinstance(h, DynamicRendezvousHandler)
            h._bg.stop()
        # without a client certificate the server refuses us
        bare = RendezvousParameters(
            "etcd", server.endpoint, "tls", 1, 1, protocol="https", cacert=tls.ca,
            read_timeout="1", **FAST,
        )  # fmt: skip
        with pytest.raises(RendezvousConnectionError):
            get_rendezvous_handler(bare).next_rendezvous()
