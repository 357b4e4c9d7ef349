"""Busy-polling: only while every other thread of the process waits, and only while it pays.

These tests drive :class:`rallypoint.rpc._spin.Waits` directly, with real threads and
socket pairs: who may spin, what ends a spin (the thread's own socket, another waiting
thread's socket, another thread woken, the window), and the policy that stops spinning
when waits stop ending within the window.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rallypoint.rpc._spin import OTHER, READY, TIMEOUT, SpinPolicy, Waits


def _fresh(window_s: float) -> Waits:
    """A record of waits in which the threads that run already (left over by other tests
    in this process) count as waiting: only the threads a test starts matter."""
    waits = Waits()
    waits.configure(window_s)
    me = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident is not None and thread.ident != me:
            waits._blocked[thread.ident] = ()
    return waits


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _blocked_on(waits: Waits, sock: socket.socket | None, release: threading.Event) -> None:
    """A thread that waits (on ``sock`` if given) until ``release``, as a reader would."""
    fds = () if sock is None else (sock.fileno(),)
    with waits.blocked(*fds):
        release.wait(10)


def test_policy_spins_while_half_of_the_recent_waits_end_in_the_window() -> None:
    assert not SpinPolicy(0.0).worth_it()  # busy_poll_us=0: never
    policy = SpinPolicy(0.001)
    assert policy.worth_it()  # a new process: assume waits are short
    for _ in range(8):
        policy.record(False)
    assert policy.worth_it()  # 8 of the last 16 still hit
    policy.record(False)
    assert not policy.worth_it()
    for _ in range(SpinPolicy.HISTORY):
        policy.record(False)
    assert not policy.worth_it()
    for _ in range(SpinPolicy.HISTORY // 2):  # blocking waits keep counting: it comes back
        policy.record(True)
    assert policy.worth_it()


@pytest.mark.timeout(20)
def test_only_a_thread_whose_siblings_all_wait_may_spin() -> None:
    waits = _fresh(0.001)
    assert waits.may_spin()  # no other thread
    release, running = threading.Event(), threading.Event()

    def busy() -> None:  # a thread running user code: it needs the GIL
        running.set()
        release.wait(10)

    worker = threading.Thread(target=busy)
    worker.start()
    running.wait(5)
    try:
        assert not waits.may_spin()
    finally:
        release.set()
        worker.join()
    release.clear()
    waiter = threading.Thread(target=_blocked_on, args=(waits, None, release))
    waiter.start()
    try:
        _until(lambda: waiter.ident in waits._blocked)
        assert waits.may_spin()  # the only other thread is blocked in a wait
        waits.configure(0.0)
        assert not waits.may_spin()  # busy_poll_us=0
    finally:
        release.set()
        waiter.join()


@pytest.mark.timeout(20)
def test_a_spin_ends_on_its_own_socket_on_another_waiters_socket_or_at_the_window(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    waits = _fresh(0.05)
    base = len(waits._blocked)
    own_r, own_w = pair
    start = time.perf_counter()
    assert waits.spin(own_r.fileno()) == TIMEOUT
    assert time.perf_counter() - start >= 0.05
    own_w.send(b"x")
    assert waits.spin(own_r.fileno()) == READY
    own_r.recv(1)
    assert waits.spin(None, lambda: True) == READY  # a latch that is free

    other_r, other_w = socket.socketpair()
    release = threading.Event()
    waiter = threading.Thread(target=_blocked_on, args=(waits, other_r, release))
    waiter.start()
    try:
        _until(lambda: len(waits._blocked) == base + 1)
        waits.configure(5.0)  # a long window: only the other socket can end it
        threading.Timer(0.05, lambda: other_w.send(b"x")).start()
        assert waits.spin(own_r.fileno()) == OTHER  # that thread has a frame: make room
    finally:
        release.set()
        waiter.join()
        other_r.close()
        other_w.close()


@pytest.mark.timeout(20)
def test_a_spin_ends_when_another_thread_is_woken_but_not_for_periodic_wakeups(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    waits = _fresh(5.0)
    base = len(waits._blocked)
    own_r, _ = pair
    latch = threading.Lock()
    latch.acquire()
    ident: list[int] = []

    def waiter() -> None:
        ident.append(threading.get_ident())
        with waits.blocked():
            latch.acquire(timeout=10)

    thread = threading.Thread(target=waiter)
    thread.start()
    ticker_stop = threading.Event()

    def ticker() -> None:  # the monitor: wakes every few ms, never urgent
        while not ticker_stop.is_set():
            waits.sleep(0.002)

    tick = threading.Thread(target=ticker)
    tick.start()
    try:
        _until(lambda: len(waits._blocked) == base + 2)

        def wake() -> None:
            waits.waking(ident[0])
            latch.release()

        threading.Timer(0.1, wake).start()
        start = time.perf_counter()
        assert waits.spin(own_r.fileno()) == OTHER
        # the ticker woke ~50 times meanwhile without ending the spin
        assert time.perf_counter() - start >= 0.09
    finally:
        ticker_stop.set()
        tick.join()
        thread.join()


@pytest.mark.timeout(20)
def test_waits_record_whether_they_ended_within_the_window(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    waits = _fresh(0.002)
    own_r, own_w = pair
    poller = select.poll()
    poller.register(own_r.fileno(), select.POLLIN)
    for _ in range(SpinPolicy.HISTORY):  # nothing comes: every spin times out
        assert not waits.wait_readable(own_r.fileno(), poller, 5)
    assert not waits.policy.worth_it()
    assert not waits.may_spin()  # spinning stopped; blocking waits still count
    for _ in range(SpinPolicy.HISTORY // 2):
        own_w.send(b"x")
        assert waits.wait_readable(own_r.fileno(), poller, 1000)
        own_r.recv(1)
    assert waits.may_spin()
    latch = threading.Lock()
    assert waits.wait_lock(latch, 1.0)  # free: taken at once, by the spin
    assert not waits.wait_lock(latch, 0.01)
    latch.release()
