"""``coordination.LighthouseClient``'s arguments, against torchft's in the same test: what
torchft accepts comes back the same in each participant (a negative step, a world size of
0, no step or world size: 0, empty data); a wrong type is a ``TypeError`` in both, an int
out of range an ``OverflowError``. Where rallypoint's lighthouse holds less than
torchft's (a name of at most 256 characters, data of at most 64 KiB as JSON), the call
says so at once instead of leaving its ask to time out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import rallypoint.ft.coordination as ours

torchft_coordination = pytest.importorskip("torchft.coordination")

SECOND = timedelta(seconds=1)


@contextlib.contextmanager
def _stacks() -> Iterator[dict[str, Any]]:
    """A lighthouse and a client of each stack, ``min_replicas`` 1."""
    made: dict[str, Any] = {}
    servers = []
    try:
        for name, module in (("torchft", torchft_coordination), ("rallypoint", ours)):
            server = module.LighthouseServer(bind="[::]:0", min_replicas=1)
            servers.append(server)
            made[name] = module.LighthouseClient(server.address(), timedelta(seconds=10))
        yield made
    finally:
        if "rallypoint" in made:
            made["rallypoint"].close()
        for server in servers:
            server.shutdown()


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[str, Any]]:
    """For calls that never reach the lighthouse."""
    with _stacks() as made:
        yield made


def _member(client: Any, replica_id: str, **kwargs: Any) -> tuple[object, ...]:
    quorum = client.quorum(replica_id=replica_id, timeout=timedelta(seconds=10), **kwargs)
    (m,) = [m for m in quorum.participants if m.replica_id == replica_id]
    return (m.replica_id, m.address, m.store_address, m.step, m.world_size, m.shrink_only,
            m.data)  # fmt: skip


ACCEPTED = [
    {},
    {"step": -5, "world_size": 0, "data": {}},
    {
        "step": 7,
        "world_size": 3,
        "shrink_only": True,
        "address": "a:1",
        "store_address": "s:2",
        "data": {"k": [1, "x"]},
    },
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", ACCEPTED, ids=["defaults", "negative-step", "every-field"])
def test_what_torchft_accepts_comes_back_the_same(kwargs: dict[str, Any]) -> None:
    # lighthouses of their own: a replica of the last quorum that does not ask again holds
    # the next round back (in both stacks), so each case asks on a new one
    with _stacks() as made:
        assert _member(made["rallypoint"], "a", **kwargs) == _member(made["torchft"], "a", **kwargs)


WRONG: list[tuple[str, Callable[[Any], object]]] = [
    ("timeout", lambda c: c.quorum(replica_id="w", timeout=1)),
    ("step", lambda c: c.quorum(replica_id="w", timeout=SECOND, step="3")),
    ("address", lambda c: c.quorum(replica_id="w", timeout=SECOND, address=5)),
    ("store_address", lambda c: c.quorum(replica_id="w", timeout=SECOND, store_address=b"s")),
    ("shrink_only", lambda c: c.quorum(replica_id="w", timeout=SECOND, shrink_only="yes")),
    ("data", lambda c: c.quorum(replica_id="w", timeout=SECOND, data=[1])),
    ("replica_id", lambda c: c.quorum(replica_id=5, timeout=SECOND)),
    ("replica_id", lambda c: c.heartbeat(5)),
    ("timeout", lambda c: c.heartbeat("w", timeout=1)),
]
SERVER_WRONG: list[tuple[str, dict[str, Any]]] = [
    ("bind", {"bind": 5, "min_replicas": 1}),
    ("min_replicas", {"bind": "[::]:0", "min_replicas": "3"}),
    ("join_timeout_ms", {"bind": "[::]:0", "min_replicas": 1, "join_timeout_ms": 1.5}),
    ("heartbeat_timeout_ms", {"bind": "[::]:0", "min_replicas": 1, "heartbeat_timeout_ms": "5"}),
]
OUT_OF_RANGE: list[tuple[str, Callable[[Any], object]]] = [
    ("world_size", lambda c: c.quorum(replica_id="w", timeout=SECOND, world_size=-1)),
    ("step", lambda c: c.quorum(replica_id="w", timeout=SECOND, step=2**63)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("arg", "call"), WRONG, ids=[f"{a}-{i}" for i, (a, _) in enumerate(WRONG)])
def test_a_wrong_type_is_a_type_error_naming_it_in_both(
    clients: dict[str, Any], arg: str, call: Callable[[Any], object]
) -> None:
    for client in clients.values():
        with pytest.raises(TypeError, match=arg):
            call(client)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("arg", "kwargs"), SERVER_WRONG, ids=[a for a, _ in SERVER_WRONG])
def test_a_servers_argument_of_a_wrong_type_is_a_type_error_in_both(
    arg: str, kwargs: dict[str, Any]
) -> None:
    for module in (torchft_coordination, ours):
        with pytest.raises(TypeError, match=arg if module is ours else None):
            module.LighthouseServer(**kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("arg", "call"), OUT_OF_RANGE, ids=[a for a, _ in OUT_OF_RANGE])
def test_an_int_out_of_range_is_an_overflow_error_in_both(
    clients: dict[str, Any], arg: str, call: Callable[[Any], object]
) -> None:
    for client in clients.values():
        with pytest.raises(OverflowError):
            call(client)
    with pytest.raises(OverflowError, match=arg):
        call(clients["rallypoint"])


BEYOND_RECORDS = [
    ({"replica_id": "r" * 257}, "replica_id must be a string of 1 to 256 characters"),
    ({"replica_id": "long-address", "address": "a" * 257}, "address is 257 characters long"),
    ({"replica_id": "big-data", "data": {"x": "d" * (64 << 10)}}, "data takes 65545 bytes"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kwargs", "says"), BEYOND_RECORDS, ids=["id", "address", "data"])
def test_what_the_lighthouse_would_refuse_is_said_at_once(
    clients: dict[str, Any], kwargs: dict[str, Any], says: str
) -> None:
    began = time.monotonic()
    with pytest.raises(ValueError, match=says):
        clients["rallypoint"].quorum(timeout=timedelta(seconds=30), **kwargs)
    assert time.monotonic() - began < 1.0
