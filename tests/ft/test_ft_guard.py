"""The cross-group process group's guard against a real lighthouse: a round that a
participant voted down is not begun by a member that learns of it late.

The race: a participant whose step failed early votes its round down, the lighthouse
tells every watcher, and a slower member of that round configures the round's group only
afterwards. Its peers never run that round's collectives, so the group it makes could
only wait out its timeout (10 s by default, seen in the full suite on a loaded machine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from rallypoint.ft._plan import Plan
from rallypoint.ft._quorum.client import post
from rallypoint.ft._quorum.records import Ask
from rallypoint.ft._quorum.watch import GroupGuard
from rallypoint.ft.coordination import LighthouseServer
from rallypoint.rendezvous import KeyValueStore, connect_kv

T = timedelta(seconds=10)


class _Group:
    """The process group the guard configures and aborts (what a manager's is, minus gloo)."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def _plan(round_: int) -> Plan:
    members = ["0:a", "1:a"]
    return Plan(round_, 1, members, 5, 0, 0, 2, members, [], False)


@pytest.fixture
def watched() -> Iterator[tuple[GroupGuard, _Group, list[Exception], KeyValueStore]]:
    server = LighthouseServer("[::]:0", min_replicas=1, join_timeout_ms=2000, say=lambda _: None)
    kv, _ = connect_kv(server.address(), timeout=T)
    group, errors = _Group(), []
    guard = GroupGuard(
        group,
        kv.clone(),
        lambda: connect_kv(server.address(), timeout=T)[0],
        errors.append,
        lambda _: None,
    )
    stop = threading.Event()
    watcher = threading.Thread(target=guard.watch, args=(stop, "0:a"), daemon=True)
    watcher.start()
    try:
        yield guard, group, errors, kv
    finally:
        stop.set()
        server.shutdown()
        watcher.join(30)


@pytest.mark.timeout(60)
def test_a_round_voted_down_before_this_member_configures_it_is_not_begun(
    watched: tuple[GroupGuard, _Group, list[Exception], KeyValueStore],
) -> None:
    guard, group, errors, kv = watched
    assert guard.configure(("life", 1), _plan(6), lambda: group.made.append(6))
    post(kv, Ask("abort", "1:a", round=7))  # a peer voted round 7 down, and then
    post(kv, Ask("abort", "1:a", round=6))  # round 6, the one this member is in
    deadline = time.monotonic() + 20  # the watcher reads the news in order, on a thread
    while group.aborts == 0 and time.monotonic() < deadline:  # of its own
        time.sleep(0.01)
    assert group.aborts == 1 and guard.ending.is_set(), "round 6 was not aborted"
    assert "round 6 was voted down" in str(errors[-1])

    errors.clear()  # this member's quorum thread reaches round 7 only now
    assert not guard.configure(("life", 2), _plan(7), lambda: group.made.append(7))
    assert group.made == [6], "a group was made for a round its peers had voted down"
    assert len(errors) == 1 and "round 7 was voted down" in str(errors[0])
    assert guard.configured is None

    errors.clear()  # the next round is configured as usual
    assert guard.configure(("life", 3), _plan(8), lambda: group.made.append(8))
    assert group.made == [6, 8] and not errors and not guard.ending.is_set()
