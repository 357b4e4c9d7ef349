"""Cutting an attempt's connections frees every rank blocked in it (``_inprocess._cut``).

torch's gloo has no working abort: a rank blocked in a collective waits until one of its
own connections fails. Four ranks in one ``all_reduce`` that rank 2 never joins (it sleeps,
alive): without a cut, rank 0 waits on ranks 1 and 3, which wait on rank 2, for good. Each
waiting rank cuts its own connections from another thread, as an interrupted worker does,
and every one of them must fail at once while rank 2 is still alive; a rank blocked in a
store wait is freed the same way. What the set-up opened before the function (a socket to
a service, the control channel) is never cut.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rallypoint._supervise._inprocess._cut import cut_attempt, sockets_now
from rallypoint.testing import run_workers

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/fdinfo"), reason="Linux only")


def _cut_later(since: frozenset[int], port: int | None, delay: float) -> None:
    def later() -> None:
        time.sleep(delay)
        cut_attempt(since, port)

    threading.Thread(target=later, daemon=True).start()


def _blocked_in_gloo(cut: bool) -> tuple[str, float]:
    rank = int(os.environ["RANK"])
    entry = sockets_now()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.barrier()
    if rank == 2:  # never joins; alive until the others are done
        time.sleep(8)
        return "slept", 0.0
    if cut:
        _cut_later(entry, None, 1.0)
    begin = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return type(exc).__name__, time.monotonic() - begin
    return "completed", time.monotonic() - begin


@pytest.mark.timeout(120)
def test_every_rank_blocked_in_a_collective_with_a_live_rank_is_freed() -> None:
    out = run_workers(_blocked_in_gloo, 4, True, timeout=60)
    for rank in (0, 1, 3):
        what, waited = out[rank]
        assert what == "RuntimeError" and waited < 4.0, (rank, out)
    assert out[2][0] == "slept"


@pytest.mark.timeout(120)
def test_without_the_cut_a_rank_waits_for_the_live_ones_exit() -> None:
    """The case the cut exists for, as torch behaves: ranks freed only by rank 2's exit."""
    out = run_workers(_blocked_in_gloo, 4, False, timeout=60)
    assert all(out[r][1] >= 6.0 for r in (0, 1, 3)), out


def _blocked_in_the_store(kept: bool) -> tuple[str, float, bool]:
    from rallypoint._core.torch_c import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    service = socket.create_connection(("127.0.0.1", server.port))  # the set-up's
    entry = sockets_now() if kept else frozenset()
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
    _cut_later(entry, server.port, 1.0)
    begin = time.monotonic()
    try:
        client.get("never-set")
        what = "returned"
    except Exception as exc:
        what = type(exc).__name__
    waited = time.monotonic() - begin
    service.setblocking(False)
    try:
        alive = service.recv(1) != b""
    except BlockingIOError:
        alive = True  # nothing to read and not shut down
    except OSError:
        alive = False
    return what, waited, alive


@pytest.mark.timeout(120)
def test_a_store_wait_is_freed_and_the_set_ups_own_connection_is_not_cut() -> None:
    what, waited, alive = run_workers(_blocked_in_the_store, 1, True, timeout=60)[0]
    assert what != "returned" and waited < 5.0, (what, waited)
    assert alive  # opened before the function: left alone


@pytest.mark.timeout(120)
def test_only_connections_made_since_the_entry_are_cut() -> None:
    """With an entry taken before the set-up's connection, that one is cut too."""
    what, waited, alive = run_workers(_blocked_in_the_store, 1, False, timeout=60)[0]
    assert what != "returned" and waited < 5.0
    assert not alive
