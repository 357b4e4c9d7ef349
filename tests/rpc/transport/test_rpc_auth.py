"""Authentication: HMAC challenge before any unpickling; bad clients never hurt the server."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint.rpc._agent._agent import current_rallypoint_agent
from rallypoint.rpc._transport import _auth, _wire
from rallypoint.testing import WorkerError, run_workers


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "ok"),
    [(b"same", b"same", True), (b"server", b"client", False)],
)
def test_handshake_in_process(server_secret: bytes, client_secret: bytes, ok: bool) -> None:
    server, client = _pair()
    result: dict[str, Any] = {}

    def serve() -> None:
        try:
            result["hello"] = _auth.server_handshake(server, server_secret, 5)
        except rpc.RpcAuthenticationError as exc:
            result["error"] = exc
            server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        if ok:
            _auth.client_handshake(client, client_secret, {"name": "w", "id": 1}, 5)
        else:
            with pytest.raises(rpc.RpcAuthenticationError, match="secrets differ"):
                _auth.client_handshake(client, client_secret, {"name": "w", "id": 1}, 5)
    finally:
        thread.join(5)
        client.close()
        server.close()
    if ok:
        assert result["hello"] == {"name": "w", "id": 1}
    else:
        assert "wrong RPC secret" in str(result["error"])


def test_server_that_does_not_know_the_secret_is_refused() -> None:
    server, client = _pair()

    # a fake server that accepts any answer and replies with a made-up proof
    def fake() -> None:
        server.sendall(b"RPRPC1\x00\x00" + b"n" * 32)
        server.recv(4096)
        server.sendall(b"OK" + b"x" * 32)

    thread = threading.Thread(target=fake)
    thread.start()
    with pytest.raises(rpc.RpcAuthenticationError, match="server failed the HMAC challenge"):
        _auth.client_handshake(client, b"secret", {"name": "w", "id": 0}, 5)
    thread.join(5)
    client.close()
    server.close()


def test_a_server_that_closes_before_its_greeting_is_gone_not_a_wrong_secret() -> None:
    # a peer that shut down with a connection still in its listen backlog: the client's
    # init_rpc takes it for a peer that left (torch's does too), not a secret mismatch
    server, client = _pair()
    server.close()
    with pytest.raises(ConnectionResetError, match="before its greeting") as caught:
        _auth.client_handshake(client, b"secret", {"name": "w", "id": 0}, 5)
    assert not isinstance(caught.value, rpc.RpcAuthenticationError)
    client.close()


def _rejections(records: list[logging.LogRecord]) -> int:
    return sum("rejected a connection" in r.getMessage() for r in records)


def _attack_scenario() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("rallypoint.rpc").addHandler(Keep())
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: dict[str, Any] = {}
    if rank == 0:
        peer = current_rallypoint_agent().peers.record("worker1")
        tcp = (peer.host, peer.port)
        # 1. garbage bytes on the TCP port: the server drops the connection
        with socket.create_connection(tcp, timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 200)
            received = b""
            try:
                while chunk := sock.recv(4096):
                    received += chunk
                out["garbage_dropped"] = "eof"
            except ConnectionResetError:
                out["garbage_dropped"] = "reset"
            assert received[:8] in (b"RPRPC1\x00\x00", b"")
        # 2. wrong secret over TCP and over the abstract Unix socket
        for address, family in ((tcp, socket.AF_INET), (peer.uds, socket.AF_UNIX)):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.connect(address)
                with pytest.raises(rpc.RpcAuthenticationError, match="secrets differ"):
                    _auth.client_handshake(sock, b"wrong", {"name": "evil", "id": 7}, 5)
        # 3. authenticated, then garbage frames: dropped, server keeps serving
        with socket.create_connection(tcp, timeout=5) as sock:
            secret = os.environ["RALLYPOINT_RPC_SECRET"].encode()
            _auth.client_handshake(sock, secret, {"name": "worker0", "id": 0}, 5)
            sock.sendall(b"\x00" * _wire.HEADER.size)
            assert sock.recv(10) == b""
        # 4. a silent client that connects and leaves
        socket.create_connection(tcp, timeout=5).close()
        out["still_serving"] = rpc.rpc_sync("worker1", max, args=(3, 9))
    rpc.shutdown()
    out["rejections"] = _rejections(records)
    return out


@pytest.mark.timeout(40)
def test_wrong_secret_and_garbage_are_rejected_and_logged() -> None:
    env = {"RALLYPOINT_RPC_SECRET": "attack-secret"}
    results = run_workers(_attack_scenario, 2, timeout=30, env=env)
    assert results[0]["garbage_dropped"] in ("eof", "reset")
    assert results[0]["still_serving"] == 9
    assert results[1]["rejections"] >= 3  # garbage + two wrong secrets (+ silent client)


def _init_one(world_size: int = 1, **options: Any) -> str:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=10, **options)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    name = rpc.rpc_sync(f"w{(rank + 1) % world_size}", _worker_name)
    rpc.shutdown()
    return str(name)


def _worker_name() -> str:
    return str(rpc.get_worker_info().name)


def _init_without_secret() -> tuple[str, float]:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=30)
    if rank == 1:
        time.sleep(1.0)  # a worker that starts late: rank 0 (the store's host) is gone
    started = time.monotonic()
    try:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    except rpc.RpcAuthenticationError as exc:
        return str(exc), time.monotonic() - started
    rpc.shutdown()
    return "started", time.monotonic() - started


@pytest.mark.timeout(40)
def test_secret_sources(tmp_path: Any) -> None:
    os.environ.pop("RALLYPOINT_RPC_SECRET", None)
    with pytest.raises(WorkerError, match="no RPC secret: set RALLYPOINT_RPC_SECRET"):
        run_workers(_init_one, 1, timeout=20)
    # every worker fails before the store exists: none waits for a store host that failed
    # (had rank 0 failed after starting the store, a later rank 1 would wait for it for
    # the whole rpc_timeout)
    for text, seconds in run_workers(_init_without_secret, 2, timeout=25):
        assert text.startswith("no RPC secret: set RALLYPOINT_RPC_SECRET"), text
        assert seconds < 10, seconds
    results = run_workers(
        _init_one, 2, 2, timeout=20, env={"RALLYPOINT_RPC_ALLOW_STORE_SECRET": "1"}
    )
    assert results == ["w1", "w0"]


def _with_secret_file(path: str) -> str:
    return _init_one(2, secret_file=path)


@pytest.mark.timeout(40)
def test_secret_file_and_mismatched_secrets(tmp_path: Any) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    assert run_workers(_with_secret_file, 2, str(secret_file), timeout=20) == ["w1", "w0"]
    results = run_workers(
        _init_one,
        2,
        2,
        timeout=30,
        env=lambda rank: {"RALLYPOINT_RPC_SECRET": f"secret-{rank}"},
        return_exceptions=True,
    )
    assert all(isinstance(r, BaseException) for r in results), results
    assert any("secrets differ" in str(r) for r in results), results


def _bytes_read_as(uid: int, name: str) -> int:
    """How many bytes of the greeting a process running as ``uid`` reads from the Unix
    socket ``name`` before the server closes it (40: it was let in)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: nothing here but system calls, then _exit
        got = -1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(name)
                got = 0
                while got < 40 and (chunk := sock.recv(40 - got)):
                    got += len(chunk)
        finally:
            os.write(w, str(got).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return int(answer)


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root (setuid)")
def test_another_users_process_is_refused_on_the_unix_socket() -> None:
    """The abstract socket has no file mode: any local user can connect. Its peer's uid
    (SO_PEERCRED) must be ours before the greeting; the server serves the next one."""
    from rallypoint.rpc._transport import _acceptor

    secret = b"uid-secret"
    admitted: list[tuple[socket.socket, bool]] = []
    came = threading.Event()
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("rallypoint.rpc").addHandler(handler)

    def admit(sock: socket.socket, uds: bool, hello: dict[str, Any]) -> None:
        admitted.append((sock, uds))
        came.set()

    acceptor = _acceptor.Acceptor("127.0.0.1", secret, admit, deadline=10.0)
    try:
        assert _bytes_read_as(65534, acceptor.uds_name) == 0, "nobody's connection got in"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(acceptor.uds_name)
            _auth.client_handshake(sock, secret, {"name": "same-uid", "id": 1}, 5)
            assert came.wait(5)
        assert [uds for _, uds in admitted] == [True]
        assert any("uid 65534" in line and "not this job's user" in line for line in lines)
    finally:
        logging.getLogger("rallypoint.rpc").removeHandler(handler)
        for sock, _ in admitted:
            sock.close()
        acceptor.close()
