"""The built-in health checks (``builtin:NAME``), each run within the check time limit.

- ``builtin:disk``: the log, snapshot and temp directories are writable
  (``_core.disk.check_writable``) with at least :data:`DISK_FLOOR` bytes free;
- ``builtin:store``: a write and a read of a probe key in the rendezvous store answer
  within :data:`STORE_LATENCY_BOUND` seconds;
- ``builtin:gpu``: in a fresh interpreter (``_gpu_probe``: CUDA is never initialised in the
  agent, whose warm process forks workers), each visible GPU allocates memory and runs a
  matmul checked against the CPU; skipped when there is no GPU.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable

from rallypoint._core.blocking import call_in_thread
from rallypoint._core.disk import check_writable, format_free, free_bytes
from rallypoint._elastic._health._check_run import CheckResult, HealthContext, run_command
from rallypoint._elastic._health._gpu_probe import NO_GPU

__all__ = ["DISK_FLOOR", "STORE_LATENCY_BOUND", "check_disk", "check_store", "run_builtin"]

DISK_FLOOR = 256 * 1024 * 1024
"""Least free bytes ``builtin:disk`` wants on each directory's filesystem."""
STORE_LATENCY_BOUND = 1.0
"""Most seconds ``builtin:store`` allows a set and a get of a probe key to take."""


def run_builtin(check: str, context: HealthContext, timeout: float) -> CheckResult:
    """Run ``builtin:NAME`` (validated by ``HealthOptions``) within ``timeout`` seconds."""
    if check == "builtin:gpu":
        return _gpu(context, timeout)
    fn: Callable[[], str] = (
        (lambda: check_disk(context.directories))
        if check == "builtin:disk"
        else (lambda: check_store(context))
    )
    started = time.monotonic()
    try:
        problem = call_in_thread(
            fn, timeout=timeout, poll=context.poll, name=f"rallypoint-health-{check[8:]}"
        )
    except TimeoutError:
        return CheckResult(check, ok=False, seconds=time.monotonic() - started, timed_out=True)
    elapsed = time.monotonic() - started
    if problem.startswith("skipped: "):
        return CheckResult(check, ok=True, seconds=elapsed, skipped=problem[9:])
    return CheckResult(check, ok=not problem, seconds=elapsed, output=problem)


def check_disk(directories: tuple[tuple[str, str], ...]) -> str:
    """What is wrong with these directories (one line each), or ``""``."""
    problems = []
    for what, path in directories:
        try:
            check_writable(path, what)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        try:
            free = free_bytes(path)
        except OSError as exc:
            problems.append(f"{what} {path}: cannot read its free space ({exc.strerror or exc})")
            continue
        if free < DISK_FLOOR:
            problems.append(
                f"{what} {path}: {format_free(free)}, below the floor of "
                f"{DISK_FLOOR // (1024 * 1024)} MiB"
            )
    return "\n".join(problems)


def check_store(context: HealthContext) -> str:
    """``""`` when the rendezvous store answers a set and a get within the bound."""
    store = context.store()
    if store is None:
        return "skipped: no rendezvous store (a single node, or the static backend)"
    key = f"rallypoint/health/{socket.gethostname()}-{os.getpid()}"
    started = time.monotonic()
    try:
        store.set(key, "1")
        store.get(key)
    except Exception as exc:
        return f"the rendezvous store failed: {type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    with contextlib.suppress(Exception):  # a probe key left behind is harmless
        store.delete_key(key)
    if took > STORE_LATENCY_BOUND:
        return (
            f"the rendezvous store answered a set and a get in {took:.2f} s, above the "
            f"bound of {STORE_LATENCY_BOUND:g} s"
        )
    return ""


def _gpu(context: HealthContext, timeout: float) -> CheckResult:
    argv = [sys.executable, "-m", "rallypoint._elastic._health._gpu_probe"]
    result = run_command("builtin:gpu", timeout, poll=context.poll, argv=argv)
    if result.exitcode == NO_GPU:
        last = result.output.strip().splitlines()[-1:] or ["no GPU"]
        return CheckResult("builtin:gpu", ok=True, seconds=result.seconds, skipped=last[0])
    return result
