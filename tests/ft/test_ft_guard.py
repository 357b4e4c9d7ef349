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
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from rallypoint.ft._plan import Plan
from rallypoint.ft._quorum.client import post, read_life
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


def _quiet(_: str) -> None:
    pass


def _house(port: int | str = 0) -> LighthouseServer:
    return LighthouseServer(f"[::]:{port}", min_replicas=1, join_timeout_ms=2000, say=_quiet)


class _Watched:
    """A guard of member ``0:a`` over a :class:`_Group`, the errors it reports, and its
    watcher thread (begun by ``start``)."""

    def __init__(self, kv: KeyValueStore, connect: Callable[[], KeyValueStore]) -> None:
        self.group = _Group()
        self.errors: list[Exception] = []
        self.guard = GroupGuard(self.group, kv.clone(), connect, self.errors.append, _quiet)
        self._stop = threading.Event()
        self._watcher = threading.Thread(
            target=self.guard.watch, args=(self._stop, "0:a"), daemon=True
        )

    def start(self) -> None:
        self._watcher.start()

    def stop(self) -> None:
        """Once the lighthouse is shut down: its watcher ends at once (not after its
        store wait's 20 s)."""
        self._stop.set()
        self._watcher.join(10)
        assert not self._watcher.is_alive(), "the watcher went on after it was stopped"


@pytest.fixture
def watched() -> Iterator[tuple[GroupGuard, _Group, list[Exception], KeyValueStore]]:
    server = _house()
    kv, _ = connect_kv(server.address(), timeout=T)
    member = _Watched(kv, lambda: connect_kv(server.address(), timeout=T)[0])
    member.start()
    try:
        yield member.guard, member.group, member.errors, kv
    finally:
        server.shutdown()  # first: the watcher's store wait (20 s) ends with it
        member.stop()


def _life(kv: KeyValueStore) -> str:
    return read_life(kv, T.total_seconds())[1]


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20  # the watcher reads the news in order, on a thread
    while not done() and time.monotonic() < deadline:  # of its own
        time.sleep(0.01)
    assert done(), what


@pytest.mark.timeout(60)
def test_a_round_voted_down_before_this_member_configures_it_is_not_begun(
    watched: tuple[GroupGuard, _Group, list[Exception], KeyValueStore],
) -> None:
    guard, group, errors, kv = watched
    life = _life(kv)
    assert guard.configure((life, 1), _plan(6), lambda: group.made.append(6))
    post(kv, Ask("abort", "1:a", round=7))  # a peer voted round 7 down, and then
    post(kv, Ask("abort", "1:a", round=6))  # round 6, the one this member is in
    _until(lambda: group.aborts == 1, "round 6 was not aborted")
    assert guard.ending.is_set()
    assert "round 6 was voted down" in str(errors[-1])

    errors.clear()  # this member's quorum thread reaches round 7 only now
    assert not guard.configure((life, 2), _plan(7), lambda: group.made.append(7))
    assert group.made == [6], "a group was made for a round its peers had voted down"
    assert len(errors) == 1 and "round 7 was voted down" in str(errors[0])
    assert guard.configured is None

    errors.clear()  # the next round is configured as usual
    assert guard.configure((life, 3), _plan(8), lambda: group.made.append(8))
    assert group.made == [6, 8] and not errors and not guard.ending.is_set()


@pytest.mark.timeout(90)
def test_after_a_lighthouse_restart_its_rounds_are_its_own_and_missed_news_are_read() -> None:
    """A lighthouse started again numbers its rounds anew: its round 6 is not the round 6
    the last life voted down (a member's quorum thread reconnects before its watcher, and
    refusing that round cost the others a 10 s rendezvous). And news posted while the
    watcher was still away are read when it is back, not skipped."""
    server = _house()
    address = server.address()
    port = address.rpartition(":")[2]
    back = threading.Event()  # the watcher's reconnect waits for this

    def connect() -> KeyValueStore:
        back.wait(30)
        return connect_kv(address, timeout=T)[0]

    kv = connect_kv(address, timeout=T)[0]
    member = _Watched(kv, connect)
    guard, group, errors = member.guard, member.group, member.errors
    member.start()
    try:
        first = _life(kv)
        assert guard.configure((first, 1), _plan(6), lambda: group.made.append(6))
        post(kv, Ask("abort", "1:a", round=6))
        _until(lambda: group.aborts == 1, "the first life's round 6 was not aborted")
        server.shutdown()
        server = _house(port)
        kv = connect_kv(address, timeout=T)[0]
        second = _life(kv)
        assert second != first
        errors.clear()  # the watcher is still away: the new life's round 6 is begun
        assert guard.configure((second, 1), _plan(6), lambda: group.made.append(66))
        assert group.made == [6, 66] and not errors, errors
        post(kv, Ask("abort", "1:a", round=6))  # ... and voted down while it is away
        back.set()
        _until(lambda: group.aborts == 2, "news posted while the watcher was away were lost")
        assert "round 6 was voted down" in str(errors[-1])
    finally:
        back.set()
        server.shutdown()  # first: the watcher's store wait (20 s) ends with it
        member.stop()


@pytest.mark.timeout(60)
def test_news_posted_before_the_watcher_first_links_are_read() -> None:
    """A round voted down between the manager's start and its watcher's first read of the
    news (a slow thread start on a loaded machine) still aborts this member's group."""
    server = _house()
    kv = connect_kv(server.address(), timeout=T)[0]
    member = _Watched(kv, kv.clone)
    group = member.group
    try:
        assert member.guard.configure((_life(kv), 1), _plan(6), lambda: group.made.append(6))
        post(kv, Ask("abort", "1:a", round=6))
        _until(lambda: (kv.get("news/last") or b"0") != b"0", "the abort was not relayed")
        member.start()  # only now
        _until(lambda: group.aborts == 1, "news posted before the watcher linked were lost")
    finally:
        server.shutdown()  # first: the watcher's store wait (20 s) ends with it
        member.stop()
