"""The torch-free common core: input checks, process liveness, ``with`` support."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint._core.checks import check_int, check_seconds, to_timedelta
from rallypoint._core.closing import Closing
from rallypoint._core.procs import pid_alive


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (True, {}, TypeError, "n must be an int, got bool True"),
        ("3", {}, TypeError, "n must be an int, got str '3'"),
        (2.0, {}, TypeError, "n must be an int, got float"),
        (0, {"minimum": 1}, ValueError, "n must be >= 1, got 0"),
        (9, {"maximum": 8}, ValueError, "n must be <= 8, got 9"),
        (None, {}, TypeError, "n must be an int, got NoneType"),
    ],
)
def test_check_int_rejects(
    value: object, kwargs: dict[str, int], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        check_int(value, "n", **kwargs)


def test_check_int_accepts() -> None:
    assert check_int(5, "n", minimum=1, maximum=5) == 5
    assert check_int(None, "n", allow_none=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (5, {}, TypeError, "t must be a datetime.timedelta, got int"),
        (True, {"numbers": True}, TypeError, "t must be seconds"),
        ("5", {"numbers": True}, TypeError, "got str"),
        (timedelta(0), {}, ValueError, "t must be > 0"),
        (timedelta(seconds=-1), {"allow_zero": True}, ValueError, "t must be >= 0"),
        (float("nan"), {"numbers": True}, ValueError, "t must be > 0"),
        (None, {}, TypeError, "got NoneType"),
    ],
)
def test_check_seconds_rejects(
    value: object, kwargs: dict[str, bool], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        check_seconds(value, "t", **kwargs)


def test_check_seconds_and_to_timedelta_accept() -> None:
    assert check_seconds(timedelta(seconds=1.5), "t") == 1.5
    assert check_seconds(0, "t", allow_zero=True, numbers=True) == 0.0
    assert check_seconds(None, "t", allow_none=True) is None
    assert to_timedelta(2, "t") == timedelta(seconds=2)
    assert to_timedelta(timedelta(seconds=3), "t") == timedelta(seconds=3)


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not pid_alive(proc.pid)


@pytest.mark.timeout(30)
def test_descendants_include_a_grandchild_in_its_own_session() -> None:
    from rallypoint._core.procs import descendants

    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= set(descendants(os.getpid()))
        assert descendants(grandchild) == []
    finally:
        child.kill()
        child.wait()
    assert child.pid not in descendants(os.getpid())  # reaped
    os.kill(grandchild, 9)


def test_closing_calls_close() -> None:
    closed: list[bool] = []

    class Thing(Closing):
        def close(self) -> None:
            closed.append(True)

    with Thing() as thing:
        assert isinstance(thing, Thing)
    assert closed == [True]


def test_exit_now_flushes_and_skips_finalization() -> None:
    script = (
        "import atexit, sys\n"
        "from rallypoint._core.procs import exit_now\n"
        "atexit.register(lambda: print('finalized'))\n"
        "print('out', end='')\n"
        "sys.stderr.write('err')\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out", "err")


_ABANDON = (
    "import sys, time\n"
    "from rallypoint._core.blocking import call_in_thread\n"
    "def slow():\n"
    "    time.sleep({sleep})\n"
    "    open(sys.argv[1], 'w').close()\n"
    "try:\n"
    "    call_in_thread(slow, timeout=0.05, finishes_within={within})\n"
    "except TimeoutError:\n"
    "    print('gave up', flush=True)\n"
)


@pytest.mark.timeout(60)
def test_exit_waits_for_an_abandoned_call_until_its_stated_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a call returning from C++ while the interpreter finalizes aborts the process
    # (exit 134); exit therefore lets an abandoned call end first
    marker = tmp_path / "ended"
    script = _ABANDON.format(sleep=1.0, within=5.0)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(marker)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (0, "gave up\n")
    assert marker.exists(), "the interpreter exited while the abandoned call still ran"
    # the seconds left of the stated 5 at exit (4 when starting up and exiting took > 0.5 s)
    waited = re.search(r"waiting up to (\d+) s at exit", proc.stderr)
    assert waited is not None and 2 <= int(waited.group(1)) <= 5, proc.stderr


@pytest.mark.timeout(60)
def test_exit_does_not_wait_long_for_a_call_with_no_stated_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "ended"
    script = _ABANDON.format(sleep=30.0, within=None)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(marker)],
        capture_output=True,
        text=True,
        timeout=20,  # a wait for the whole call would run past this
        check=False,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "gave up\n", "")
    assert not marker.exists()


@pytest.mark.timeout(30)
def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    from rallypoint._core.net import free_ports

    for _ in range(50):  # the kernel reused a just-closed probe's port for free_port twice
        ports = free_ports(6)
        assert len(set(ports)) == 6
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.timeout(30)
def test_free_ports_lie_below_the_ports_outgoing_connections_take() -> None:
    """A port from port 0 can be any connection's local port before its taker binds it (a
    test's store said "already in use" on a loaded machine); these cannot."""
    from rallypoint._core.net import free_port, free_ports

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists() or int(ranges.read_text().split()[0]) <= 11_000:
        pytest.skip("no room below this kernel's range of local ports")
    low = int(ranges.read_text().split()[0])
    ports = [free_port(), free_port("::1"), *free_ports(20)]
    assert all(10_000 <= port < low for port in ports), (low, ports)


@pytest.mark.timeout(30)
def test_await_listener_waits_for_a_server_to_listen_and_says_why_it_gave_up() -> None:
    """The wait a lighthouse client and an in-process restart make for a store: it ends
    as soon as something listens, at its deadline with why, or when told to give up."""
    import socket
    import threading
    import time

    from rallypoint._core.net import await_listener, free_port

    port = free_port()
    start = time.monotonic()
    assert await_listener("127.0.0.1", port, start + 0.5) == "connection refused"
    assert 0.3 < time.monotonic() - start < 5
    start = time.monotonic()
    assert await_listener("127.0.0.1", port, start + 30, give_up=lambda: True) == "not tried"
    assert time.monotonic() - start < 1
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    later = threading.Timer(0.5, lambda: (server.bind(("127.0.0.1", port)), server.listen()))
    later.start()
    try:
        start = time.monotonic()
        assert await_listener("[127.0.0.1]", port, start + 20) == ""
        assert 0.4 < time.monotonic() - start < 10
    finally:
        later.join(10)
        server.close()


@pytest.mark.timeout(30)
def test_a_reserved_port_is_kept_from_others_but_a_store_can_listen_on_it() -> None:
    """run_workers' MASTER_PORT: a plain bind (another process's) is refused while held, and
    rank 0's TCPStore still binds and serves it (c10d sets SO_REUSEADDR)."""
    import errno
    import socket

    import torch.distributed as dist

    from rallypoint._core.net import reserved_port

    with reserved_port() as port:
        with socket.socket() as thief, pytest.raises(OSError) as refused:
            thief.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        wait = timedelta(seconds=10)
        server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=wait, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=wait)
        client.set("k", "v")
        assert server.get("k") == b"v"
