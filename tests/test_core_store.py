"""The one store protocol (``rallypoint._core.store.Store``): the stores rallypoint hands
out and the ones tests pass do what it says. The source rules (no ``torch._C`` outside
``rallypoint._core.torch_c``, no store typed ``Any``) are in ``test_source_rules.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest


def _memory_store() -> object:
    from rallypoint.rendezvous import MemoryKV

    return MemoryKV().torch_store("p")


def _agent_memory_store() -> object:
    from rallypoint._core.memory_store import MemoryStore

    return MemoryStore().under("p")


def _hash_store() -> object:
    from rallypoint._core.torch_c import HashStore

    return HashStore()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "make",
    [_hash_store, _memory_store, _agent_memory_store],
    ids=["HashStore", "MemoryKV", "MemoryStore"],
)
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


@pytest.mark.timeout(30)
def test_the_agents_memory_store_answers_as_torchs_prefix_store() -> None:
    """A one-node job's rounds live in ``MemoryStore``: the same calls on it and on torch's
    ``PrefixStore`` over a ``HashStore`` give the same answers, views under other prefixes
    included, and a ``get`` waits for a key another thread sets."""
    import threading

    from rallypoint._core.memory_store import MemoryStore
    from rallypoint._core.torch_c import HashStore, PrefixStore

    ours, torchs = MemoryStore(), HashStore()
    pairs = [
        (ours.under("a"), PrefixStore("a", torchs)),
        (ours.under("b"), PrefixStore("b", torchs)),
    ]
    nested = (ours.under("a").under("r"), PrefixStore("r", PrefixStore("a", torchs)))
    for mine, theirs in [*pairs, nested]:
        for call in (
            lambda s: s.add("n", 1),
            lambda s: s.add("n", 0),
            lambda s: s.compare_set("c", "x", "y"),  # absent, expected not empty
            lambda s: s.check(["c"]),
            lambda s: s.compare_set("c", "", "v"),
            lambda s: s.compare_set("c", "v", "w"),
            lambda s: s.compare_set("c", "nope", "z"),
            lambda s: s.check(["n", "c"]),
            lambda s: s.delete_key("c"),
            lambda s: s.delete_key("c"),
            lambda s: s.num_keys(),
        ):
            assert call(mine) == call(theirs)
    late = (ours.under("late"), PrefixStore("late", torchs))
    for store in late:
        timer = threading.Timer(0.2, lambda s=store: s.set("k", "v"))
        timer.start()
        assert store.get("k") == b"v"
        timer.join()
    with pytest.raises(RuntimeError, match="no second connection"):
        ours.clone()


def test_as_torch_store_refuses_what_torch_cannot_take() -> None:
    from rallypoint._core.torch_c import HashStore, as_torch_store

    store = HashStore()
    assert as_torch_store(store) is store
    with pytest.raises(TypeError, match="c10d Store"):
        as_torch_store(object())  # type: ignore[arg-type]
