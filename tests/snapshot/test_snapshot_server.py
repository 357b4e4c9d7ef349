"""The node's snapshot server (forked by a real warm process), driven by its client."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint._snapshot._auth import client_handshake
from rallypoint._snapshot._client import NodeClient, ServerError
from rallypoint._snapshot._server import HANDSHAKE_SECONDS
from rallypoint._supervise._warm._process import WarmProcess

SECRET = b"job-secret"


@pytest.fixture
def nodes() -> Iterator[list[tuple[str, int]]]:
    """Three nodes' snapshot servers: ``(socket path, pid)`` each."""
    warms = [WarmProcess.fork(import_torch=False) for _ in range(3)]
    try:
        servers = []
        for warm in warms:
            warm.init(())
            servers.append(warm.start_snapshots()[:2])
        yield servers
    finally:
        for warm in warms:
            warm.close()


def _client(path: str, secret: bytes = SECRET) -> NodeClient:
    return NodeClient(path, secret, timeout=20)


def _write(c: NodeClient, key: tuple[str, int], data: bytes, keep=None, replica=None, world=2):
    slot = c.begin(0, world, key, len(data), keep)
    slot.view[: len(data)] = data
    c.commit(0, world, key, slot.index, keep, replica)
    return c.commit_reply()


def _addr(c: NodeClient) -> str:
    return f"127.0.0.1:{c.port}"


def _held(c: NodeClient) -> list[tuple[int, str, int]]:
    return sorted((r["rank"], r["gen"], r["step"]) for r in c.inventory()["records"])


@pytest.mark.timeout(60)
def test_two_slots_per_rank_and_reads_back_bytes(nodes: list[tuple[str, int]]) -> None:
    c = _client(nodes[0][0])
    keep = None
    for step in range(1, 6):
        assert _write(c, ("g", step), bytes([step]) * 5000, keep)["replica"] == "none"
        keep = ("g", step)
    assert _held(c) == [(0, "g", 4), (0, "g", 5)]  # never more than two per rank
    assert c.inventory()["held"] == 2 * 8192  # two page-rounded memfds
    slot = c.open(0, 2, ("g", 5))
    assert bytes(slot.view[: slot.nbytes]) == b"\x05" * 5000
    with pytest.raises(ServerError, match="not here"):
        c.open(0, 2, ("g", 3))
    with pytest.raises(ServerError, match="not here"):
        c.open(0, 4, ("g", 5))  # another world's rank 0


@pytest.mark.timeout(60)
def test_interrupted_write_is_never_listed_and_the_previous_one_stays(
    nodes: list[tuple[str, int]],
) -> None:
    c = _client(nodes[0][0])
    _write(c, ("g", 1), b"a" * 100)
    _write(c, ("g", 2), b"b" * 100, keep=("g", 1))
    slot = c.begin(0, 2, ("g", 3), 100, ("g", 2))  # staged, then the worker dies
    slot.view[:100] = b"c" * 100
    c.close()
    c = _client(nodes[0][0])
    assert _held(c) == [(0, "g", 2)]
    slot = c.open(0, 2, ("g", 2))
    assert bytes(slot.view[:100]) == b"b" * 100


@pytest.mark.timeout(60)
def test_replica_on_the_peer_and_a_replacement_fetches_it(
    nodes: list[tuple[str, int]],
) -> None:
    a, b, c = (_client(path) for path, _ in nodes)
    reply = _write(a, ("g", 7), b"x" * 300_000, replica=_addr(b))
    assert reply == {"ok": True, "replica": "ok", "error": ""}
    assert _held(b) == [(0, "g", 7)]
    slot = c.fetch(0, 2, ("g", 7), _addr(b))  # node a is gone; c takes its place
    assert bytes(slot.view[: slot.nbytes]) == b"x" * 300_000
    assert _held(c) == [(0, "g", 7)]
    with pytest.raises(ServerError, match="no complete snapshot"):
        c.fetch(0, 2, ("g", 8), _addr(b))


@pytest.mark.timeout(60)
def test_a_peer_with_another_secret_gets_nothing(nodes: list[tuple[str, int]]) -> None:
    a = _client(nodes[0][0])
    b = _client(nodes[1][0], b"another job")
    reply = _write(a, ("g", 1), b"x" * 100, replica=_addr(b))
    assert reply["replica"] == "failed" and "secret" in reply["error"], reply
    assert _held(b) == []
    with pytest.raises(ServerError, match="secret"):
        a.fetch(0, 2, ("g", 1), _addr(b))
    with pytest.raises(ServerError, match="not the node's"):
        _client(nodes[0][0], b"a third secret")  # one secret per node


@pytest.mark.timeout(60)
def test_strangers_on_the_tcp_port_are_dropped_and_peers_still_served(
    nodes: list[tuple[str, int]],
) -> None:
    a, b = _client(nodes[0][0]), _client(nodes[1][0])
    garbage = socket.create_connection(("127.0.0.1", b.port))
    garbage.sendall(os.urandom(4096))
    garbage.settimeout(5)
    got = b""
    with contextlib.suppress(ConnectionResetError):  # (a reset: our bytes were unread)
        while chunk := garbage.recv(100):
            got += chunk
    # the challenge, the rejection of a wrong proof (all zero bytes), then the drop
    assert got[:8] == b"RPSNAPA1" and got[8 + 32 :].strip(b"\x00") == b"", got
    silent = [socket.create_connection(("127.0.0.1", b.port)) for _ in range(64)]
    start = time.monotonic()
    _write(a, ("g", 1), b"y" * 100, replica=_addr(b))  # while strangers hold connections
    # it waited for none of them: waiting for one alone takes HANDSHAKE_SECONDS (a bound
    # that a loaded machine's plain write stays far below)
    assert time.monotonic() - start < HANDSHAKE_SECONDS
    assert _held(b) == [(0, "g", 1)]
    for s in silent:
        s.settimeout(HANDSHAKE_SECONDS + 3)
        data = b""
        while chunk := s.recv(100):  # closed once the handshake deadline passed
            data += chunk
        assert len(data) <= 40
        s.close()
    assert time.monotonic() - start < HANDSHAKE_SECONDS + 4


@pytest.mark.timeout(60)
def test_the_socket_directory_is_private_and_slots_have_no_name(
    nodes: list[tuple[str, int]],
) -> None:
    path, pid = nodes[0]
    mode = os.stat(os.path.dirname(path)).st_mode
    assert stat.S_IMODE(mode) == 0o700
    c = _client(path)
    _write(c, ("g", 1), b"z" * 100)
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    memfds = [link for link in links if link.startswith("/memfd:")]
    assert memfds and all(link.endswith("(deleted)") for link in memfds), links
    assert not [p for p in os.listdir("/dev/shm") if "snapshot" in p]


# A server that can afford about eight connection threads: each takes a 64 MiB stack and
# the address space allows eight more (as a pids cgroup limit would, without being root).
_FEW_THREADS = """
import os, resource, socket, threading
from rallypoint._snapshot._server import Server
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(f"\\0rallypoint-test-{os.getpid()}")
listener.listen(8)
server = Server(listener)
server.learn_secret(b"job-secret")
port = server.listen("127.0.0.1")
threading.stack_size(64 << 20)
status = open("/proc/self/status").read()
vm = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 8 * (64 << 20) + (32 << 20),) * 2)
print(port, flush=True)
server.run()
"""


@pytest.mark.timeout(60)
def test_peers_are_served_again_after_the_server_ran_out_of_threads() -> None:
    """A flood of strangers while the server cannot start another thread, then a peer
    is served: the accept loop outlives ``can't start new thread``. (Strangers cost no
    thread, their handshakes share one selector thread; an authenticated peer takes one.)"""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # no 64 MiB malloc arena per thread
    server = subprocess.Popen(
        [sys.executable, "-c", _FEW_THREADS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(24)]
        time.sleep(1)  # every thread the server could start waits in a handshake
        for s in strangers:
            s.close()  # their threads end: the server has threads to spare again
        with socket.create_connection(("127.0.0.1", port), timeout=5) as peer:
            client_handshake(peer, SECRET, time.monotonic() + 2 * HANDSHAKE_SECONDS)
        assert server.poll() is None
    finally:
        server.kill()
        _, err = server.communicate()
    assert "can't start new thread" not in err, err


_SERVER = """
import socket, sys
from rallypoint._snapshot._server import Server
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(8)
print("ready", flush=True)
Server(listener).run()
"""

# A worker: says hello, asks for the inventory and is SIGKILLed, with the answer unread
# (``wait`` 1: the answer came) or before the server could send it (``wait`` 0).
_DYING_WORKER = """
import json, os, signal, socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(sys.argv[1])
sock.send(json.dumps({"op": "hello", "secret": b"job-secret".hex(), "host": "127.0.0.1"}).encode())
assert json.loads(sock.recv(65536))["ok"] is True
sock.send(json.dumps({"op": "inventory"}).encode())
time.sleep(float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_worker_that_dies_mid_request_is_dropped_quietly_and_bad_data_is_said(
    tmp_path: Path,
) -> None:
    """A worker that dies with a request or an answer in flight (every worker crash) is
    expected: no line. Malformed data from a live worker is still said, in one line."""
    path = str(tmp_path / "server.sock")
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        for wait in ("1", "0", "1", "0"):
            worker = subprocess.run([sys.executable, "-c", _DYING_WORKER, path, wait])
            assert worker.returncode == -9
        time.sleep(0.5)  # the server saw those ends
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
            live.connect(path)
            live.send(b"{not json")
            live.settimeout(5)
            assert live.recv(100) == b""  # dropped
        assert server.poll() is None  # and still serving
        time.sleep(0.2)
    finally:
        server.kill()
        _, err = server.communicate()
    assert "ConnectionResetError" not in err and "BrokenPipeError" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "dropped a worker connection: ProtocolError" in lines[0], err
