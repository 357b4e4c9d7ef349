"""Cutting an attempt's connections frees every rank blocked in it (``_inprocess._cut``).

torch's gloo has no working abort: a rank blocked in a collective waits until one of its
own connections fails. Four ranks in one ``all_reduce`` that rank 2 never joins (it sleeps,
alive): without a cut, rank 0 waits on ranks 1 and 3, which wait on rank 2, for good. Each
waiting rank cuts its own connections from another thread, as an interrupted worker does,
and every one of them must fail at once while rank 2 is still alive; a rank blocked in a
store wait is freed the same way. What the set-up opened before the function (a socket to
a service, the control channel) is never cut.

gloo loses a send it could not write (``EPIPE``) when the connection fails before its
event loop wrote it: the collective waits its whole timeout. A send made after a cut, by
this rank or a peer, and before this rank's loop saw it must not be lost: the tests stop
the sender's gloo loop thread (``ptrace``, from the peer) to make that order certain.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rallypoint._worker_side._cut import cut_attempt, sockets_now
from rallypoint.testing import run_workers

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/fdinfo"), reason="Linux only")


HELD: list[socket.socket] = []  # a worker's cut sockets (each test's workers are forked)


def _cut_later(since: frozenset[int], port: int | None, delay: float) -> None:
    def later() -> None:
        time.sleep(delay)
        cut_attempt(since, port, HELD)

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


_PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_DETACH, _WALL = 0x4206, 0x4207, 17, 0x40000000


def _ptrace(request: int, tid: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    return bool(libc.ptrace(request, tid, None, None) == 0)


def _stop_thread(tid: int) -> bool:
    """Stop thread ``tid`` of another process (until a ``PTRACE_DETACH``); False where
    ptrace is not allowed."""
    if not _ptrace(_PTRACE_SEIZE, tid):
        return False
    if not _ptrace(_PTRACE_INTERRUPT, tid):
        _ptrace(_PTRACE_DETACH, tid)
        return False
    os.waitpid(tid, _WALL)
    return True


def _gloo_loop_thread() -> int:
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as fp:
            if fp.read().strip() == "gloo_tcp_loop":
                return int(tid)
    raise AssertionError("no gloo loop thread")


def _send_after_the_cut(who: str, path: str) -> tuple[str, float]:
    """Rank 1 posts a receive from rank 0 and stops rank 0's gloo loop; then ``who`` (rank
    0: ``self``, rank 1: ``peer``) cuts, rank 0 sends (its loop has not seen the cut) and
    cuts too, and rank 1 lets rank 0's loop go on: rank 0's send must end at once. The
    store is a file: a TCPStore's server in rank 0 would be cut too (under rallypoint the
    agent hosts it), and rank 1's waits in it would fail."""
    rank = int(os.environ["RANK"])
    entry = sockets_now()
    store = dist.FileStore(path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=15)
    )
    dist.barrier()
    if rank == 1:
        received = dist.irecv(torch.zeros(4), src=0)
        store.set("posted", "1")
        loop = int(store.get("loop"))
        if not _stop_thread(loop):
            store.set("stopped", "no")
            return "no ptrace", 0.0
        if who == "peer":
            cut_attempt(entry, None, HELD)
        store.set("stopped", "yes")
        store.wait(["sent"])
        _ptrace(_PTRACE_DETACH, loop)
        try:
            received.wait()
        except RuntimeError:
            return "recv failed", 0.0
        return "recv completed", 0.0
    store.set("loop", str(_gloo_loop_thread()))
    store.wait(["posted"])
    time.sleep(0.3)  # rank 1's receive is known here: the send below writes at once
    if store.get("stopped") == b"no":
        return "no ptrace", 0.0
    time.sleep(0.2)  # a peer's cut has reached this rank
    if who == "self":
        cut_attempt(entry, None, HELD)
    sent = dist.isend(torch.ones(4), dst=1)
    cut_attempt(entry, None, HELD)
    store.set("sent", "1")
    begin = time.monotonic()
    try:
        sent.wait()
        what = "sent"
    except RuntimeError as exc:
        what = str(exc).splitlines()[0][-100:]
    return what, time.monotonic() - begin


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["self", "peer"])
def test_a_send_made_before_gloo_saw_the_cut_is_not_lost(who: str, tmp_path: Path) -> None:
    """A cut that shut down the writing side (``self``: this rank's write fails; ``peer``:
    the peer's end answers with a reset) left gloo a send it could not write, which it
    never failed: the sender waited its whole timeout (15 s here), as a rank of an 8-rank
    DDP job under heavy load did in ``loss.backward()``."""
    out = run_workers(_send_after_the_cut, 2, who, str(tmp_path / "store"), timeout=60)
    if out[1][0] == "no ptrace":
        pytest.skip("ptrace is not allowed here")
    assert out[0][1] < 5.0, out
