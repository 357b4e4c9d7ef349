"""A process forked while its other threads hold rallypoint's module locks, or run calls
in threads, finds the locks free and no call running (rallypoint._core.forking)."""

from __future__ import annotations

import ast
import importlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from rallypoint._core import blocking
from rallypoint.testing import _workers, run_workers

SRC = Path(__file__).resolve().parents[1] / "src" / "rallypoint"


@pytest.fixture(autouse=True)
def _fork_from_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about a process forked while its own threads run (a launcher's warm
    process, run_workers outside a zygote): the session's zygote would hide that."""
    monkeypatch.setattr(_workers, "_ZYGOTE", None)


@contextmanager
def held_by_another_thread(lock: Any) -> Iterator[None]:
    """``lock`` held by a thread of this process for the duration of the block."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def _call_in_a_thread() -> int:
    return blocking.call_in_thread(lambda: 7, timeout=5)


@pytest.mark.timeout(60)
def test_a_child_forked_while_another_thread_ends_a_call_can_run_calls_in_threads() -> None:
    # an abandoned store connect ends (and takes the lock of the running calls) in the
    # parent just as the workers are forked
    with held_by_another_thread(blocking._RUNNING_LOCK):
        assert run_workers(_call_in_a_thread, 2, timeout=20) == [7, 7]


def _running_calls() -> list[str]:
    return blocking.running_calls()


@pytest.mark.timeout(60)
def test_a_child_does_not_count_or_wait_at_exit_for_its_parents_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # run_workers would first wait up to 10 s for the parent's call to end: not the point
    monkeypatch.setattr(_workers, "_SETTLE_WAIT", 0.0)
    release = threading.Event()
    call = blocking.InThread(lambda: release.wait(60), name="parent-call", finishes_within=60)
    try:
        assert "parent-call" in blocking.running_calls()
        assert run_workers(_running_calls, 1, timeout=20) == [[]]
    finally:
        release.set()
        call.wait(10)


_LOCK_MAKERS = {"Lock", "RLock", "Condition", "Semaphore", "fork_safe_lock"}


def _locks_in(body: list[ast.stmt], prefix: str) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _locks_in(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else ast.unparse(func)
            if isinstance(target, ast.Name) and called in _LOCK_MAKERS:
                yield prefix + target.id


def _now() -> float:
    return time.monotonic()  # the same clock in every process


@pytest.mark.timeout(60)
def test_run_workers_forks_once_a_call_abandoned_in_a_thread_has_ended() -> None:
    # what the test before a hang left behind: a store connect given up on, still in
    # torch's C++ code (whose locks a child forked meanwhile could inherit held)
    ended: list[float] = []

    def connect() -> None:
        time.sleep(1.0)
        ended.append(time.monotonic())

    call = blocking.InThread(connect, name="abandoned-connect", finishes_within=5)
    [child_started] = run_workers(_now, 1, timeout=30)
    assert call.wait(10)
    assert ended and child_started >= ended[0]


@pytest.mark.timeout(60)
def test_a_call_with_no_stated_end_is_not_waited_for() -> None:
    release = threading.Event()
    call = blocking.InThread(lambda: release.wait(60), name="blocked-for-good")
    try:
        start = time.monotonic()
        blocking.settle_before_fork(30)
        assert time.monotonic() - start < 10
        assert call.age < 30 and "blocked-for-good" in blocking.running_calls()
    finally:
        release.set()
        call.wait(10)


def _module_locks() -> list[tuple[str, str]]:
    """``(module, name)`` of every lock made when a module of rallypoint is imported (at
    module level, or a class attribute: ``Class.name``)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        found += [(module, name) for name in _locks_in(ast.parse(path.read_text()).body, "")]
    return found


MODULE_LOCKS = _module_locks()


def test_every_module_lock_is_made_by_fork_safe_lock() -> None:
    assert len(MODULE_LOCKS) >= 10
    for module, name in MODULE_LOCKS:
        source = (SRC.parent / (module.replace(".", "/") + ".py")).read_text()
        assert f"{name.split('.')[-1]} = fork_safe_lock()" in source, f"{module}.{name}"


def _lock(module: str, name: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _acquire(module: str, name: str) -> bool:
    lock = _lock(module, name)
    got = bool(lock.acquire(timeout=2))
    if got:
        lock.release()
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("module", "name"), MODULE_LOCKS)
def test_a_module_lock_held_at_fork_is_free_in_the_child(module: str, name: str) -> None:
    with held_by_another_thread(_lock(module, name)):
        assert run_workers(_acquire, 1, module, name, timeout=20) == [True]
