"""The one store protocol (``rallypoint._core.store.Store``): the stores rallypoint hands
out and the ones tests pass do what it says. The source rules (no ``torch._C`` outside
``rallypoint._core.torch_c``, no store typed ``Any``) are in ``test_source_rules.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest


def _memory_store() -> object:
    from rallypoint.rendezvous import MemoryKV

    return MemoryKV().torch_store("p")


def _hash_store() -> object:
    from rallypoint._core.torch_c import HashStore

    return HashStore()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [_hash_store, _memory_store], ids=["HashStore", "MemoryKV"])
def test_stores_do_what_the_protocol_says(make: object) -> None:
    """Every method of the protocol, on torch's in-memory store and on the in-memory fake
    (what tests pass where a store is wanted)."""
    from rallypoint._core.store import Store

    assert callable(make)
    store: Store = make()
    store.set("a", "1")
    store.set("b", b"2")
    assert store.get("a") == b"1" and store.get("b") == b"2"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("c", b"y", b"z") == b"x"  # expected value differs: unchanged
    store.append("log", "a")
    store.append("log", b"b")
    assert store.get("log") == b"ab"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"])
    store.multi_set(["m1", "m2"], ["x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    assert store.delete_key("a") and not store.check(["a"])
    store.wait(["b"])
    store.wait(["b"], timedelta(seconds=1))
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    with pytest.raises((LookupError, RuntimeError)):
        store.wait(["nope"], timedelta(seconds=0.1))


def test_as_torch_store_refuses_what_torch_cannot_take() -> None:
    from rallypoint._core.torch_c import HashStore, as_torch_store

    store = HashStore()
    assert as_torch_store(store) is store
    with pytest.raises(TypeError, match="c10d Store"):
        as_torch_store(object())  # type: ignore[arg-type]
