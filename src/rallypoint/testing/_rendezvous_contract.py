"""The contract every rendezvous key-value backend passes.

Subclass :class:`KVContract` in a test module and provide a ``kv`` fixture that yields a
fresh :class:`~rallypoint.rendezvous.KeyValueStore`. The same assertions then run against
the in-memory fake, TCPStore, FileStore and a real etcd server, so a backend that passes
behaves the same for the dynamic handler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import pytest

from rallypoint.rendezvous import KeyValueStore, KVStateError

T = TypeVar("T")


def _threads(n: int, fn: Callable[[int], T]) -> list[T]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # SystemExit too: reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


class KVContract:
    """Behaviour shared by every :class:`KeyValueStore` implementation.

    ``kv`` must be fresh for each test (isolated, e.g. by a unique key prefix)::

        class TestMemoryKV(KVContract):
            @pytest.fixture
            def kv(self):
                yield MemoryKV()
    """

    def test_get_missing_is_none(self, kv: KeyValueStore) -> None:
        assert kv.get("missing") is None

    def test_set_get_roundtrip_binary(self, kv: KeyValueStore) -> None:
        value = bytes(range(256))
        kv.set("bin", value)
        assert kv.get("bin") == value
        kv.set("bin", b"second")
        assert kv.get("bin") == b"second"

    def test_get_woken_reads_as_get_and_leaves_a_missing_key_missing(
        self, kv: KeyValueStore
    ) -> None:
        kv.set("woken", bytes(range(256)))
        assert kv.get_woken("woken") == bytes(range(256))
        assert kv.get_woken("woken/missing") is None
        assert kv.get("woken/missing") is None
        assert not kv.wait(["woken/missing"], timedelta(seconds=0.05))

    def test_multi_get_mixed_and_multi_set(self, kv: KeyValueStore) -> None:
        kv.multi_set([("m/a", b"1"), ("m/b", b"2")])
        assert kv.multi_get(["m/a", "m/missing", "m/b"]) == [b"1", None, b"2"]
        keys = [f"many/{i}" for i in range(150)]  # more than one etcd transaction
        kv.multi_set([(k, str(i).encode()) for i, k in enumerate(keys)])
        assert kv.multi_get(keys) == [str(i).encode() for i in range(150)]

    def test_add_counts_from_zero(self, kv: KeyValueStore) -> None:
        assert kv.add("ctr", 1) == 1
        assert kv.add("ctr", 5) == 6
        assert kv.add("ctr", 0) == 6
        assert kv.add("ctr", -2) == 4
        assert kv.get("ctr") == b"4"

    def test_add_is_atomic_under_contention(self, kv: KeyValueStore) -> None:
        def work(_: int) -> list[int]:
            return [kv.clone().add("race", 1) for _ in range(10)]

        results = _threads(6, work)
        seen = sorted(v for r in results for v in r)
        assert seen == list(range(1, 61))

    def test_enroll_gives_unique_dense_numbers(self, kv: KeyValueStore) -> None:
        assert kv.enrolled("arrivals") == 0

        def work(i: int) -> list[int]:
            other = kv.clone()
            return [other.enroll("arrivals", f"node{i}-{j}") for j in range(5)]

        numbers = sorted(v for r in _threads(6, work) for v in r)
        assert numbers == list(range(1, 31))
        assert kv.enrolled("arrivals") == 30

    def test_add_on_garbage_is_state_error(self, kv: KeyValueStore) -> None:
        kv.set("garbage", b"not a number")
        with pytest.raises(KVStateError, match="garbage"):
            kv.add("garbage", 1)
        # the store stays usable afterwards
        assert kv.add("after-garbage", 1) == 1

    def test_set_if_absent_first_writer_wins(self, kv: KeyValueStore) -> None:
        assert kv.set_if_absent("once", b"first") == b"first"
        assert kv.set_if_absent("once", b"second") == b"first"
        assert kv.get("once") == b"first"

    def test_set_if_absent_exactly_one_winner(self, kv: KeyValueStore) -> None:
        results = _threads(8, lambda i: (i, kv.clone().set_if_absent("claim", b"node%d" % i)))
        winners = {value for _, value in results}
        assert len(winners) == 1
        (winner,) = winners
        assert sum(1 for i, v in results if v == b"node%d" % i) == 1
        assert kv.get("claim") == winner

    def test_compare_and_swap(self, kv: KeyValueStore) -> None:
        assert kv.compare_and_swap("cas", b"", b"a") == b"a"
        assert kv.compare_and_swap("cas", b"x", b"b") == b"a"
        assert kv.compare_and_swap("cas", b"a", b"b") == b"b"
        assert kv.get("cas") == b"b"
        # a missing key with a non-empty expectation stays missing (c10d semantics)
        assert kv.compare_and_swap("cas-missing", b"x", b"y") == b"x"
        assert kv.get("cas-missing") is None

    def test_append_keeps_every_writers_bytes_whole(self, kv: KeyValueStore) -> None:
        def write(i: int) -> None:
            writer = kv.clone()
            for j in range(5):
                writer.append("log", b"<%d.%d>" % (i, j))
            writer.get("log")  # (an append may be applied after it returns: not after this)

        _threads(8, write)
        value = kv.get("log") or b""
        parts = sorted(value.strip(b"<>").split(b"><"))
        assert parts == sorted(b"%d.%d" % (i, j) for i in range(8) for j in range(5))

    def test_wait_present_missing_and_late(self, kv: KeyValueStore) -> None:
        kv.set("w/here", b"1")
        assert kv.wait(["w/here"], timedelta(seconds=5)) is True
        start = time.monotonic()
        assert kv.wait(["w/here", "w/never"], timedelta(seconds=0.3)) is False
        assert 0.25 <= time.monotonic() - start < 5
        writer = kv.clone()
        timer = threading.Timer(0.2, lambda: writer.set("w/late", b"1"))
        timer.start()
        start = time.monotonic()
        assert kv.wait(["w/late"], timedelta(seconds=10)) is True
        assert time.monotonic() - start < 5
        timer.join()

    def test_wait_is_not_fooled_by_a_reader(self, kv: KeyValueStore) -> None:
        # reading a missing key must not wake a waiter on it (libuv TCPStore pitfall)
        reader = kv.clone()
        timer = threading.Timer(0.1, lambda: reader.get("w/absent"))
        timer.start()
        assert kv.wait(["w/absent"], timedelta(seconds=0.5)) is False
        timer.join()

    def test_delete(self, kv: KeyValueStore) -> None:
        kv.set("gone", b"1")
        kv.delete("gone")
        assert kv.get("gone") is None

    def test_clone_sees_the_same_data(self, kv: KeyValueStore) -> None:
        other = kv.clone()
        kv.set("shared", b"v")
        assert other.get("shared") == b"v"

    def test_torch_store_over_the_same_data(self, kv: KeyValueStore) -> None:
        store = kv.torch_store("round/store")
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert kv.get("round/store/k") == b"v"
        assert store.add("n", 2) == 2
        assert store.add("n", 3) == 5
        assert store.compare_set("c", b"", b"x") == b"x"
        assert store.compare_set("c", b"x", b"y") == b"y"
        assert store.check(["k", "n"]) is True
        assert store.check(["k", "nope"]) is False
        store.wait(["k"], timedelta(seconds=1))
        with pytest.raises((LookupError, RuntimeError)):
            store.wait(["nope"], timedelta(seconds=0.2))
        other = kv.torch_store("round2/store")
        assert other.check(["k"]) is False
