"""The KV contract on the in-memory fake, TCPStore and FileStore (etcd: test_rendezvous_etcd)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rallypoint.rendezvous import KeyValueStore, KVConnectionError, MemoryKV
from rallypoint.rendezvous._kv_c10d import C10dKV, file_kv, tcp_kv
from rallypoint.testing._rendezvous_contract import KVContract

_ids = itertools.count()


class TestMemoryKV(KVContract):
    @pytest.fixture
    def kv(self) -> Iterator[KeyValueStore]:
        yield MemoryKV()


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[tuple[C10dKV, int]]:
    kv, server = tcp_kv("127.0.0.1", 0, is_server=True, timeout=timedelta(seconds=30))
    yield kv, int(kv.endpoint.rsplit(":", 1)[1])
    del server


class TestTCPStoreKV(KVContract):
    @pytest.fixture
    def kv(self, tcp_server: tuple[C10dKV, int]) -> Iterator[KeyValueStore]:
        from torch.distributed import PrefixStore, TCPStore

        _, port = tcp_server
        prefix = f"t{next(_ids)}/"

        def connect() -> PrefixStore:
            client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            return PrefixStore(prefix, client)

        # clones share one side connection (as handlers in one process do)
        yield C10dKV(
            connect(), endpoint=f"127.0.0.1:{port}", connect=connect, share_key=f"test:{prefix}"
        )

    @pytest.mark.timeout(60)
    def test_a_set_is_applied_when_it_returns(self, kv: KeyValueStore) -> None:
        """torch's TCPStore client returns from ``set`` before the server applied it (a
        read on another connection missed about 1 write in 800 here); the KV returns after."""
        other = kv.clone()
        assert other is not kv
        missed = []
        for i in range(5000):
            kv.set(f"w{i}", b"v")
            if other.get(f"w{i}") is None:
                missed.append(i)
        assert missed == []
        kv.multi_set([(f"m{i}", b"v") for i in range(3)])
        assert other.multi_get([f"m{i}" for i in range(3)]) == [b"v"] * 3


def test_a_read_after_a_wake_is_one_round_trip(tcp_server: tuple[C10dKV, int]) -> None:
    """``get_woken`` asks the server once (``get``: ``check``, then ``get``); a missing key
    reads as missing and stays missing."""
    from torch.distributed import TCPStore

    _, port = tcp_server
    calls: list[str] = []

    class Counting:
        def __init__(self) -> None:
            self.store = TCPStore("127.0.0.1", port, is_master=False)

        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(self.store, name)

    kv = C10dKV(Counting(), endpoint=f"127.0.0.1:{port}")  # type: ignore[arg-type]
    key = f"read{next(_ids)}"
    kv.set(key, b"v")
    calls.clear()
    assert kv.get_woken(key) == b"v" and calls == ["compare_set"]
    assert kv.get(key) == b"v" and calls == ["compare_set", "check", "get"]
    calls.clear()
    assert kv.get_woken(key + "/missing") is None and calls == ["compare_set"]
    assert not kv.check([key + "/missing"])


class TestFileStoreKV(KVContract):
    @pytest.fixture
    def kv(self, tmp_path: Path) -> Iterator[KeyValueStore]:
        yield file_kv(str(tmp_path / "store"))


@pytest.mark.timeout(60)
def test_wait_confirms_the_keys_and_wait_woken_returns_at_the_wake(
    tcp_server: tuple[C10dKV, int],
) -> None:
    """libuv's TCPStore wakes the waiters of a missing key on a compare-and-swap that sets
    nothing: ``wait`` checks and waits on, ``wait_woken`` returns (its caller reads the key
    and finds it missing)."""
    import threading
    import time

    from torch.distributed import TCPStore

    _, port = tcp_server

    def client() -> C10dKV:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        return C10dKV(store, endpoint=f"127.0.0.1:{port}")

    key = f"woken{next(_ids)}"
    woken: dict[str, bool] = {}

    def waiter(name: str, kv: C10dKV) -> None:
        method = kv.wait if name == "wait" else kv.wait_woken
        woken[name] = method([key], timedelta(seconds=3))

    threads = [threading.Thread(target=waiter, args=(n, client())) for n in ("wait", "woken")]
    for t in threads:
        t.start()
    time.sleep(0.5)
    began = time.monotonic()
    other = client()
    assert other.compare_and_swap(key, b"not there", b"v") == b"not there"
    for t in threads:
        t.join(10)
    assert woken == {"wait": False, "woken": True}, woken
    assert other.get(key) is None and time.monotonic() - began > 2.0


def test_tcp_unreachable_names_the_endpoint() -> None:
    from rallypoint._core.net import free_port

    port = free_port()
    with pytest.raises(KVConnectionError, match=f"127.0.0.1:{port}"):
        tcp_kv("127.0.0.1", port, is_server=False, timeout=timedelta(seconds=1))


def test_memory_fault_injection() -> None:
    kv = MemoryKV()
    kv.fail_after(1)
    kv.set("a", b"1")
    with pytest.raises(KVConnectionError, match="injected"):
        kv.get("a")
    kv.fail_after(None)
    assert kv.get("a") == b"1"
