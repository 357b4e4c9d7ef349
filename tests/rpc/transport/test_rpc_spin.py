"""Busy-polling: only while every other thread of the process waits, and only while it pays.

These tests drive :class:`rallypoint.rpc._transport._spin.Waits` directly, with real threads and
socket pairs: who may spin, what ends a spin (the thread's own socket, another waiting
thread's socket, another thread woken, the window, a CPU that another task holds), and
the policy that stops spinning when waits stop ending within the window.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rallypoint.rpc._transport import _spin
from rallypoint.rpc._transport._spin import OTHER, READY, TIMEOUT, WAITS, SpinPolicy, Waits

CONTENDED_S = _spin.CONTENDED_S


@pytest.fixture(autouse=True)
def _cpu_never_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spin whose yield takes a time slice elsewhere ends early (TIMEOUT), as it should
    on a busy host such as a loaded CI machine; only the tests of that rule may see it."""
    monkeypatch.setattr(_spin, "CONTENDED_S", float("inf"))


def _prune(waits: Waits) -> Waits:
    """Forget left-over threads that ended since :func:`_fresh` (a daemon thread of an
    earlier test ending mid-test made the count of threads one less than the waits)."""
    alive = {t.ident for t in threading.enumerate()}
    for ident in [i for i in waits._blocked if i not in alive]:
        del waits._blocked[ident]
    return waits


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


def test_policy_spins_where_half_of_the_recent_gaps_of_a_site_ended_in_the_window() -> None:
    assert not SpinPolicy(0.0).worth_it()  # busy_poll_us=0: never
    policy = SpinPolicy(0.001)
    served_forward, sent_gradient = object(), object()
    assert policy.worth_it(served_forward)  # a new site: assume its gaps are short
    for _ in range(SpinPolicy.HISTORY // 2):
        policy.record(False, served_forward)
        policy.record(True, sent_gradient)
    assert policy.worth_it(served_forward)  # half of the last gaps still hit
    policy.record(False, served_forward)
    assert not policy.worth_it(served_forward)
    assert policy.worth_it(sent_gradient)  # sites do not mix
    for _ in range(SpinPolicy.HISTORY // 2):  # gaps keep counting: it comes back
        policy.record(True, served_forward)
    assert policy.worth_it(served_forward)


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
        assert not _prune(waits).may_spin()
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

        start = time.perf_counter()
        threading.Timer(0.1, wake).start()
        assert waits.spin(own_r.fileno()) == OTHER
        # the ticker woke ~50 times meanwhile without ending the spin
        assert time.perf_counter() - start >= 0.09
    finally:
        ticker_stop.set()
        tick.join()
        thread.join()


@pytest.mark.timeout(20)
def test_a_gap_counts_for_the_site_where_the_process_went_idle_whoever_ends_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    waits = _fresh(0.002)
    own_r, own_w = pair
    poller = select.poll()
    poller.register(own_r.fileno(), select.POLLIN)

    def send_later(sock: socket.socket, seconds: float) -> threading.Thread:
        waiting = threading.Event()

        def run() -> None:  # a rallypoint-like thread: it says that it waits
            with waits.blocked(urgent=False):
                waiting.set()
                time.sleep(seconds)
            sock.send(b"x")

        thread = threading.Thread(target=run)
        thread.start()
        waiting.wait(5)
        return thread

    base = len(waits._blocked)
    slow, fast = "after the forward", "after the gradient"
    # the window changes between the two kinds of gap so that neither depends on how
    # fast this machine is: a 100 ms gap misses a 2 ms window, an instant one hits 1 s
    for _ in range(SpinPolicy.HISTORY):  # this site's frames come after the window
        waits.policy.window_s = 0.002
        sender = send_later(own_w, 0.1)
        assert waits.wait_readable(own_r.fileno(), poller, 1000, slow)
        own_r.recv(1)
        sender.join()
        waits.policy.window_s = 1.0
        own_w.send(b"x")  # and this one's at once
        assert waits.wait_readable(own_r.fileno(), poller, 1000, fast)
        own_r.recv(1)
    assert not waits.policy.worth_it(slow)
    assert not waits.may_spin(slow)
    assert waits.may_spin(fast)

    # a gap that another thread's socket ends counts too: a stage whose gradient comes
    # on one connection and its next request on another. Each thread stays blocked until
    # this one releases it, so the gap begins at this thread's wait, however slow the host
    other_r, other_w = socket.socketpair()
    stop = threading.Event()

    def other_reader() -> None:  # no timeout: a wake-up of its own would begin a gap
        other_poller = select.poll()
        other_poller.register(other_r.fileno(), select.POLLIN)
        while not stop.is_set():
            if waits.wait_readable(other_r.fileno(), other_poller, -1):
                other_r.recv(1)

    def send_when(go: threading.Event) -> threading.Thread:
        def run() -> None:
            with waits.blocked(urgent=False):
                go.wait(10)
            other_w.send(b"x")

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    thread = threading.Thread(target=other_reader)
    thread.start()
    waits.policy.window_s = 10.0  # the other socket's frame comes within 10 s, however slow
    try:
        for _ in range(SpinPolicy.HISTORY // 2):
            _until(lambda: len(waits._blocked) == base + 1)
            go = threading.Event()
            sender = send_when(go)
            _until(lambda: len(waits._blocked) == base + 2)  # both others wait
            assert not waits.wait_readable(own_r.fileno(), poller, 20, slow)  # own: nothing
            go.set()
            sender.join()
            _until(lambda: waits._gap is None)  # the reader got the frame: the gap ended
        assert waits.policy.worth_it(slow)
    finally:
        stop.set()
        other_w.send(b"x")
        thread.join()
        other_r.close()
        other_w.close()


@pytest.mark.timeout(120)
def test_a_wait_ends_at_its_timeout_even_when_the_spin_window_is_longer(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A 60 s window (``busy_poll_us`` set high) must not stretch a 50 ms wait: the
    spin counts against the caller's timeout, and the wait that follows gets the rest (the
    bound is far from both, for a loaded machine)."""
    waits = _fresh(60.0)
    own_r, _ = pair
    poller = select.poll()
    poller.register(own_r.fileno(), select.POLLIN)
    latch = threading.Lock()
    assert waits.wait_lock(latch, 1.0)  # free: taken at once
    for wait in (
        lambda: waits.wait_lock(latch, 0.05),
        lambda: waits.wait_readable(own_r.fileno(), poller, 50),
    ):
        assert waits.may_spin()  # nobody else runs, and a new site is worth a try
        began = time.monotonic()
        assert not wait()
        assert time.monotonic() - began < 20.0  # the timeout, not the 60 s window
    latch.release()


@pytest.mark.timeout(20)
def test_a_spin_survives_another_thread_starting_to_wait_while_it_lists_the_sockets() -> None:
    """Another thread may start or stop waiting while a spinner lists the sockets to
    poll: a garbage collection amid that listing runs Python code (finalizers, GC
    callbacks), and the interpreter may switch threads there. The spinner then crashed
    with ``dictionary changed size during iteration``, and a reader thread that crashed
    broke its connection. A GC callback stands in for the other thread here."""
    import gc

    waits = _fresh(0.0)
    a, b = socket.socketpair()
    others = [socket.socketpair() for _ in range(4)]
    for other, _ in others:
        waits._blocked[-other.fileno()] = (other.fileno(),)
    changes = 0

    def another_thread_waits(phase: str, info: dict[str, int]) -> None:
        nonlocal changes
        changes += 1
        waits._blocked[10_000 + changes] = ()  # a thread starts waiting meanwhile

    threshold = gc.get_threshold()
    gc.callbacks.append(another_thread_waits)
    gc.set_threshold(1)  # every allocation of a tracked object may collect
    try:
        for _ in range(200):
            poller = waits._poller(a.fileno())
            assert isinstance(poller, type(select.poll()))
        b.send(b"x")
        assert waits._poller(a.fileno()).poll(1000)  # the listing holds the thread's socket
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(another_thread_waits)
        for one in (a, b, *(s for pair in others for s in pair)):
            one.close()
    assert changes > 0  # the GC did run amid the listings


@pytest.mark.timeout(20)
def test_a_forked_child_does_not_count_its_parents_waiting_threads(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Only the forking thread lives on in a child (a DataLoader worker, a worker forked
    from a warm process): a thread of the parent that waited must not make the child
    think that every other thread waits, or a child's thread would spin beside one
    that runs."""
    import os

    own_r, _ = pair
    release = threading.Event()
    before = len(WAITS._blocked)
    thread = threading.Thread(target=_blocked_on, args=(WAITS, own_r, release))
    thread.start()
    try:
        _until(lambda: len(WAITS._blocked) == before + 1)
        pid = os.fork()
        if pid == 0:  # the child: exit at once, with what it sees
            os._exit(0 if not WAITS._blocked and WAITS._gap is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # 1: the parent's waiter was counted
        assert len(WAITS._blocked) == before + 1  # the parent's own record is untouched
    finally:
        release.set()
        thread.join()


@pytest.mark.timeout(120)
def test_a_spin_that_finds_its_cpu_taken_stops_and_spinning_pauses_while_it_lasts(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A yield that returns only after a time slice means that another task holds the
    CPU; a frame arriving meanwhile would wait for the slice to end. The spin stops, the
    wait blocks (and is woken at once when the frame comes), and nobody spins for a pause
    that doubles while it goes on; a spin that keeps the CPU resets it."""
    real_yield = os.sched_yield
    monkeypatch.setattr(_spin, "CONTENDED_S", CONTENDED_S)
    waits = _fresh(60.0)  # a long window: only the taken CPU can end these spins early
    own_r, own_w = pair
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(0.005))  # a slice elsewhere
    pauses = []
    for _ in range(2):
        _until(waits.may_spin)
        began = time.monotonic()
        assert waits.spin(own_r.fileno()) == TIMEOUT
        assert time.monotonic() - began < 20.0  # not the 60 s window (a loaded machine)
        pauses.append(waits._calm_at - time.perf_counter())
        assert not waits.may_spin()  # paused
    assert waits.contended == 2
    assert _spin.PAUSE_MIN_S / 2 < pauses[0] <= _spin.PAUSE_MIN_S
    assert pauses[1] > pauses[0] * 1.5  # doubled: the CPU is still taken

    # a wait in a pause blocks and still gets its frame
    poller = select.poll()
    poller.register(own_r.fileno(), select.POLLIN)
    threading.Timer(0.05, lambda: own_w.send(b"x")).start()
    assert waits.wait_readable(own_r.fileno(), poller, 5000)
    assert waits.contended == 2  # it did not spin
    own_r.recv(1)

    monkeypatch.setattr(os, "sched_yield", real_yield)
    monkeypatch.setattr(_spin, "CONTENDED_S", float("inf"))  # a free CPU, even on a busy host
    _until(waits.may_spin)
    waits.configure(0.01)
    assert waits.spin(own_r.fileno()) == TIMEOUT  # the window: 10 ms on a free CPU
    assert waits._pause == _spin.PAUSE_MIN_S  # reset


@pytest.mark.timeout(30)
def test_a_spinner_beside_a_busy_process_on_its_cpu_stops_within_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same with a real CPU-bound process on the spinner's CPU: its yields hand that
    process a time slice, so the spin stops and counts it, instead of spinning out a 2 s
    window."""
    monkeypatch.setattr(_spin, "CONTENDED_S", CONTENDED_S)
    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    waits = _fresh(2.0)
    a, b = socket.socketpair()
    try:
        time.sleep(0.3)  # the hog is running on that CPU
        os.sched_setaffinity(0, {cpu})  # this thread only
        began = time.monotonic()
        outcome = waits.spin(a.fileno())
        spun = time.monotonic() - began
    finally:
        os.sched_setaffinity(0, saved)
        hog.kill()
        hog.wait(10)
        a.close()
        b.close()
    assert outcome == TIMEOUT
    assert waits.contended == 1, spun
    assert spun < 1.5, spun
