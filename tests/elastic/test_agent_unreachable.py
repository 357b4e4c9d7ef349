"""Agents whose rendezvous store cannot be reached, or stops answering.

Three kinds of endpoint: a port nobody listens on (refused), a server that accepts and never
answers (a wrong port on a busy host, a half-dead store), and one that accepts and closes.
Every connect ends after the stated ``read_timeout`` (not twice it) with one line and no
C++ frames, and SIGINT/SIGTERM stop the agent within a second in every phase, even while a
store call is blocked in torch's C++ ``recv``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint._core.net import free_port

RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]
SIGNAL_BOUND = 1.0
"""Seconds from SIGINT/SIGTERM to the agent's exit."""


class Endpoint:
    """A loopback endpoint: ``refused`` (nothing listens), ``silent`` (accepts, never
    answers), ``close`` (accepts and closes), or ``proxy`` to ``target`` (forwards until
    :meth:`freeze`, then holds every connection open without answering)."""

    def __init__(self, mode: str, target: tuple[str, int] | None = None) -> None:
        self.mode, self.target = mode, target
        self.accepted = threading.Event()
        self.frozen = threading.Event()
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        if mode == "refused":
            self.port = free_port()
            return
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._start(self._serve)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.set()
            if self.mode == "close":
                conn.close()
                continue
            self._conns.append(conn)
            if self.mode == "proxy":
                assert self.target is not None
                upstream = socket.create_connection(self.target)
                self._conns.append(upstream)
                for a, b in ((conn, upstream), (upstream, conn)):
                    self._start(self._pipe, a, b)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if self.frozen.is_set():
                self._closed.wait()  # hold the bytes: the peer waits until the test ends
                return
            if not data:
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        """Stop serving and end every thread (none outlives the test: the test process
        forks the next tests' workers)."""
        self._closed.set()
        for sock in ([self._sock] if self._sock is not None else []) + self._conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread in accept() or recv()
            sock.close()
        for thread in self._threads:
            thread.join(10)


@contextmanager
def endpoint(mode: str, target: tuple[str, int] | None = None) -> Iterator[Endpoint]:
    ep = Endpoint(mode, target)
    try:
        yield ep
    finally:
        ep.close()


def _agent(
    backend: str, address: str, conf: str, script: Path, *args: str
) -> subprocess.Popen[str]:
    cmd = [
        *RALLYPOINT, "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", backend, "--rdzv-endpoint", address, "--rdzv-id", "job",
        "--rdzv-conf", conf, "--shutdown-timeout", "2", str(script), *args,
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _only_line(err: str) -> str:
    """The agent's stderr is one line: no traceback, no torch C++ log or frame."""
    lines = [line for line in err.strip().splitlines() if "OMP_NUM_THREADS" not in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "frame #" not in err and ".cpp" not in err, err
    return lines[0]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text("print('hello')\n")
    return path


# ---------------------------------------------------------------------------- connect bound
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["refused", "silent", "close"])
def test_a_tcpstore_connect_ends_within_its_timeout(mode: str) -> None:
    import torch.distributed  # noqa: F401  (not timed)

    from rallypoint.rendezvous import KVConnectionError
    from rallypoint.rendezvous._kv_c10d import tcp_kv

    with endpoint(mode) as ep:
        start = time.monotonic()
        with pytest.raises(KVConnectionError) as info:
            tcp_kv("127.0.0.1", ep.port, is_server=False, timeout=timedelta(seconds=5))
        elapsed = time.monotonic() - start
    # its timeout, not twice it (a margin of 5 s for a loaded host)
    assert 5.0 <= elapsed < 10.0, elapsed
    why = "connection refused" if mode == "refused" else "accepts connections but does not answer"
    assert f"Cannot reach the TCPStore at {ep.address} within 5 s: " in str(info.value)
    assert why in str(info.value), info.value


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["refused", "silent", "close"])
def test_an_unreachable_c10d_endpoint_is_one_line_after_read_timeout(
    mode: str, script: Path
) -> None:
    with endpoint(mode) as ep:
        start = time.monotonic()
        proc = _agent("c10d", ep.address, "is_host=false,read_timeout=2", script)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1, err
    line = _only_line(err)
    assert line.startswith(f"rallypoint run: rendezvous '{ep.address}': Cannot reach the TCPStore")
    assert "within 2 s" in line, line
    assert elapsed >= 2.0, elapsed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["refused", "silent"])
def test_an_unreachable_etcd_is_one_line_after_read_timeout(mode: str, script: Path) -> None:
    with endpoint(mode) as ep:
        start = time.monotonic()
        proc = _agent("etcd", ep.address, "read_timeout=3", script)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1, err
    line = _only_line(err)
    assert line.startswith(f"rallypoint run: rendezvous '{ep.address}': Cannot reach etcd at "), (
        line
    )
    assert f"http://{ep.address} within 3 s" in line, line
    assert elapsed >= 3.0, elapsed


# ---------------------------------------------------------------------------- signals
def _stop_within_bound(proc: subprocess.Popen[str], signum: int) -> str:
    """Send ``signum``; the agent exits with 128 + signum within the bound, saying so."""
    start = time.monotonic()
    proc.send_signal(signum)
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()
    elapsed = time.monotonic() - start
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert elapsed < SIGNAL_BOUND, f"{signal.Signals(signum).name}: exited after {elapsed:.2f} s"
    last = err.strip().splitlines()[-1]
    assert f"received {signal.Signals(signum).name}" in last, err
    return last


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_signal_stops_an_agent_blocked_on_a_silent_endpoint(
    backend: str, signum: int, script: Path
) -> None:
    with endpoint("silent") as ep:
        conf = "read_timeout=120" + (",is_host=false" if backend == "c10d" else "")
        proc = _agent(backend, ep.address, conf, script)
        assert ep.accepted.wait(60), "the agent never connected"
        time.sleep(0.5)  # inside the blocking connect (TCPStore's ping, etcd's first request)
        last = _stop_within_bound(proc, signum)
    assert "while waiting for the rendezvous store" in last, last


TRAIN = """
import sys, time
from pathlib import Path
from typing import Any
import torch.distributed as dist
dist.init_process_group("gloo")
Path(sys.argv[1], f"ready{dist.get_rank()}").write_text("")
time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, None])
def test_a_store_that_stops_answering_during_training(tmp_path: Path, signum: int | None) -> None:
    """The monitor loop's store calls hang in C++: a signal still stops the agent within the
    bound, and without one the store counts as lost after ``read_timeout``."""
    import torch.distributed as dist

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with endpoint("proxy", ("127.0.0.1", store.port)) as ep:
        conf = "is_host=false,read_timeout=3,last_call_timeout=0.5"
        agents = [_agent("c10d", ep.address, conf, script, str(tmp_path)) for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
                assert time.monotonic() < deadline and all(a.poll() is None for a in agents)
                time.sleep(0.05)
            time.sleep(0.3)
            ep.freeze()
            time.sleep(0.5)  # every tick's store calls now block in recv
            if signum is not None:
                for agent in agents:
                    _stop_within_bound(agent, signum)
                return
            for agent in agents:
                _, err = agent.communicate(timeout=60)
                assert agent.returncode == 1, err
                last = err.strip().splitlines()[-1]
                assert "lost the rendezvous store: no answer within 3 s" in last, err
        finally:
            for agent in agents:
                agent.kill()
                agent.communicate()
    del store
