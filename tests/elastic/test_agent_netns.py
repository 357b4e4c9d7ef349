"""The network-namespace harness: two hosts talk over TCP, a cut link drops, restore heals."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from rallypoint.testing._netns import (
    NetnsError,
    Network,
    netns_available,
    remove_stale_namespaces,
)

_ok, _why = netns_available()


def needs_netns(fn: Callable[..., None]) -> Callable[..., None]:
    """Marked `netns` (select with -m netns) and skipped with the reason where unavailable."""
    return pytest.mark.netns(pytest.mark.skipif(not _ok, reason=_why)(fn))


SERVER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 29500))
srv.listen()
print("listening", flush=True)
while True:
    conn, addr = srv.accept()
    with conn:
        data = conn.recv(100)
        conn.sendall(data.upper() + b" from " + addr[0].encode())
"""

CLIENT = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 29500), timeout=float(sys.argv[2])) as s:
        s.sendall(b"hello")
        print("ok", s.recv(100).decode())
except OSError as exc:
    print("fail", type(exc).__name__)
"""


def _connect(runner: Network | None, host_index: int, target: str, timeout: float) -> str:
    cmd = [sys.executable, "-S", "-c", CLIENT, target, str(timeout)]
    if runner is None:  # the machine's own namespace
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    else:
        out = runner.hosts[host_index].run(cmd, capture_output=True, text=True).stdout
    return out.strip()


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


@needs_netns
@pytest.mark.timeout(60)
def test_two_hosts_cut_and_restore() -> None:
    links_before = _root_links()
    with Network(2) as net:
        a, b = net.hosts
        assert (a.address, b.address) == ("198.18.0.1", "198.18.0.2")
        assert set(net.namespaces) == {a.name, b.name, net.bridge_ns}
        server = b.popen([sys.executable, "-S", "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"

        assert _connect(net, 0, b.address, 2.0) == "ok HELLO from 198.18.0.1"
        assert _connect(net, 0, "h1", 2.0) == "ok HELLO from 198.18.0.1"  # by host name
        # each host has its own loopback: the server is not on host a's 127.0.0.1
        assert _connect(net, 0, "127.0.0.1", 2.0) == "fail ConnectionRefusedError"
        assert _connect(net, 1, "127.0.0.1", 2.0) == "ok HELLO from 127.0.0.1"
        # the machine's own namespace has no route into the test network
        assert _connect(None, 0, b.address, 0.5).startswith("fail")

        b.cut()
        assert b.is_cut
        start = time.monotonic()
        assert _connect(net, 0, b.address, 0.5) == "fail TimeoutError"  # dropped, not refused
        assert time.monotonic() - start < 30  # its 0.5 s, not the system's connect timeout

        b.restore()
        deadline = time.monotonic() + 10
        while (result := _connect(net, 0, b.address, 1.0)) != "ok HELLO from 198.18.0.1":
            assert time.monotonic() < deadline, result
        assert not b.is_cut
        assert server.poll() is None

        # a thread of this process inside host a's namespace reaches b without a process
        def hello() -> bytes:
            with socket.create_connection((b.address, 29500), timeout=2) as conn:
                conn.sendall(b"thread")
                return conn.recv(100)

        assert a.call(hello) == b"THREAD from 198.18.0.1"
        assert b.call(hello) == b"THREAD from 198.18.0.2"  # the thread is in b this time
        with pytest.raises(ZeroDivisionError):  # its failure is ours
            a.call(lambda: 1 // 0)
    # closing killed the server and removed every namespace and link
    assert server.wait(5) is not None
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.prefix not in names
    assert _root_links() == links_before
    assert not os.path.exists(f"/etc/netns/{a.name}")
    with pytest.raises(ValueError, match="is closed"):
        a.popen(["true"])
    net.close()  # idempotent


@needs_netns
@pytest.mark.timeout(60)
def test_cleanup_on_error_and_stale_namespaces() -> None:
    # an exception inside the block still removes everything
    with pytest.raises(RuntimeError, match="boom"), Network(1) as net:
        raise RuntimeError("boom")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.prefix not in names
    # a failure half-way through building (the name exists already) cleans up what was made
    with Network(1) as first:
        with pytest.raises(NetnsError, match="netns add"):
            Network(2, prefix=first.prefix)
        assert set(first.namespaces) <= set(_netns_list())  # the first is untouched
    # namespaces of a test process that was SIGKILLed are removed by the next Network
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal; from rallypoint.testing._netns import Network; "
            "n = Network(1); print(n.prefix, flush=True); os.kill(os.getpid(), signal.SIGKILL)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    leaked = child.stdout.strip()
    assert leaked and any(name.startswith(leaked) for name in _netns_list())
    assert os.path.exists(f"/etc/netns/{leaked}-h0/hosts")
    remove_stale_namespaces()  # or a Network of another test process did, just before
    assert not os.path.exists(f"/etc/netns/{leaked}-h0")
    assert not any(name.startswith(leaked) for name in _netns_list())
    assert not any(name.startswith(leaked) for name in _netns_list())


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nhosts must be between 1 and 250, got 0"):
        Network(0)
    with pytest.raises(TypeError, match="nhosts must be an int"):
        Network("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix 'bad name' must be"):
        Network(1, prefix="bad name")


def test_unavailable_reason_for_non_root() -> None:
    if os.geteuid() != 0:
        ok, why = netns_available()
        assert not ok and "root" in why
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setuid(65534)
            netns_available.cache_clear()
            os.write(write, repr(netns_available()).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    answer = os.read(read, 1000).decode()
    os.close(read)
    assert answer == repr(
        (False, "network namespaces need root (CAP_SYS_ADMIN); run the tests as root")
    )


NAMES = "import socket; print(socket.gethostname(), socket.getfqdn(), socket.gethostbyname('h0'))"

GLOO = r"""
import sys
from datetime import timedelta
import torch, torch.distributed as dist
rank = int(sys.argv[1])
# no GLOO_SOCKET_IFNAME: gloo finds its address from the host name, as on real machines
dist.init_process_group("gloo", init_method="tcp://h0:29511", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(int(t.item()), flush=True)
dist.destroy_process_group()
"""


@needs_netns
@pytest.mark.timeout(90)
def test_host_names_and_gloo_across_hosts() -> None:
    machine = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    with Network(2) as net:
        out = net.hosts[1].run([sys.executable, "-S", "-c", NAMES], capture_output=True, text=True)
        assert out.stdout.split() == ["h1", "h1", "198.18.0.1"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        procs = [
            h.popen(
                [sys.executable, "-c", GLOO, str(i)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i, h in enumerate(net.hosts)
        ]
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr
            assert stdout.strip() == "3"
    # the machine's own host name is untouched (each host has its own UTS namespace)
    assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() == machine
