"""ReaderPool: reader threads are reused, bounded, and leave when idle or closed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from rallypoint.rpc._transport._reader_pool import ReaderPool


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.mark.timeout(20)
def test_a_finished_thread_runs_the_next_task_under_its_name() -> None:
    pool = ReaderPool(max_parked=4)
    ran: list[tuple[threading.Thread, str]] = []

    def task() -> None:
        ran.append((threading.current_thread(), threading.current_thread().name))

    pool.run("rpc-reader-a", task)
    _until(lambda: pool.parked() == 1)
    pool.run("rpc-reader-b", task)
    _until(lambda: len(ran) == 2 and pool.parked() == 1)
    assert ran[0][0] is ran[1][0] and pool.started == 1
    assert [name for _, name in ran] == ["rpc-reader-a", "rpc-reader-b"]
    pool.close()
    _until(lambda: not ran[0][0].is_alive())


@pytest.mark.timeout(20)
def test_at_most_max_parked_wait_and_idle_ones_leave() -> None:
    pool = ReaderPool(max_parked=1, idle_seconds=0.3)
    gate = threading.Event()
    threads: list[threading.Thread] = []

    def blocked() -> None:
        threads.append(threading.current_thread())
        gate.wait(10)

    pool.run("rpc-reader-1", blocked)
    pool.run("rpc-reader-2", blocked)  # none parked: a second thread
    _until(lambda: len(threads) == 2)
    assert pool.started == 2
    gate.set()
    _until(lambda: sum(t.is_alive() for t in threads) == 1)  # one parks, one leaves
    assert pool.parked() == 1
    _until(lambda: not any(t.is_alive() for t in threads))  # idle for 0.3 s: it leaves
    assert pool.parked() == 0


@pytest.mark.timeout(20)
def test_after_close_tasks_still_run_and_no_thread_stays() -> None:
    pool = ReaderPool(max_parked=2)
    pool.close()
    done = threading.Event()
    threads: list[threading.Thread] = []

    def task() -> None:
        threads.append(threading.current_thread())
        done.set()

    pool.run("rpc-reader-late", task)
    assert done.wait(5)
    _until(lambda: not threads[0].is_alive())
    assert pool.parked() == 0


@pytest.mark.timeout(20)
def test_a_task_that_raises_does_not_kill_the_thread(caplog: pytest.LogCaptureFixture) -> None:
    pool = ReaderPool(max_parked=1)
    seen: list[threading.Thread] = []

    def bad() -> None:
        seen.append(threading.current_thread())
        raise ValueError("boom")

    pool.run("rpc-reader-x", bad)
    _until(lambda: pool.parked() == 1)
    pool.run("rpc-reader-y", bad)
    _until(lambda: len(seen) == 2 and pool.parked() == 1)
    assert seen[0] is seen[1]
    assert "a reader thread failed" in caplog.text
    pool.close()
