"""The shared acceptor (``rallypoint._core.acceptor``): caps per peer address, the
throttled rejection log, and the handshake both ends of which live in ``_core``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _support.strangers import Holder
from rallypoint._core.acceptor import Acceptor, RejectionLog
from rallypoint._core.handshake import (
    HandshakeError,
    Scheme,
    ServerHandshake,
    client_handshake,
)

SCHEME = Scheme(what="test", magic=b"RPTEST01", client_label=b"c", server_label=b"s", hello=True)
SECRET = b"core-secret"


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, level: int, text: str) -> None:
        with self._lock:
            self.lines.append(text)

    def wait_for(self, predicate: Any, timeout: float = 5) -> list[str]:
        deadline = time.monotonic() + timeout
        while not predicate(self.lines) and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.lines)


@pytest.fixture
def served() -> Iterator[tuple[Acceptor, _Lines, list[dict[str, Any]]]]:
    lines, hellos = _Lines(), []
    tcp = socket.create_server(("127.0.0.1", 0))

    def admit(sock: socket.socket, uds: bool, hello: dict[str, Any]) -> None:
        hellos.append(hello)
        sock.close()

    acceptor = Acceptor(
        [tcp], lambda: ServerHandshake(SECRET, SCHEME), admit, deadline=10, log=lines, name="t"
    )
    try:
        yield acceptor, lines, hellos
    finally:
        acceptor.close()


def _port(acceptor: Acceptor) -> int:
    return int(acceptor._listeners[0][0].getsockname()[1])


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    assert len(sock.recv(40)) == 40  # greeted: pending
    return sock


@pytest.mark.timeout(30)
def test_one_address_cannot_push_out_the_handshake_of_another(
    served: tuple[Acceptor, _Lines, list[dict[str, Any]]],
) -> None:
    """A flood from one address drops that address's handshakes, never another address's:
    with one cap for all, the flood pushed out the oldest (the peer's)."""
    acceptor, lines, hellos = served
    acceptor._cap = 8  # at most 4 from one address
    port = _port(acceptor)
    peer = socket.create_connection(("127.0.0.1", port), timeout=5)
    peer.settimeout(5)
    peer.recv(40, socket.MSG_PEEK)  # greeted, so pending: the oldest handshake
    flood = [_connect(port, "127.0.0.2") for _ in range(20)]
    lines.wait_for(lambda seen: len(seen) >= 5)
    # the last one is greeted before the acceptor's thread counts it: wait for the count
    lines.wait_for(lambda _: len(acceptor._pending) == 5)
    assert len(acceptor._pending) == 5, acceptor._pending
    client_handshake(peer, SECRET, SCHEME, time.monotonic() + 5, {"name": "peer"})
    assert lines.wait_for(lambda _: hellos) and hellos == [{"name": "peer"}]
    for sock in [peer, *flood]:
        sock.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("grace", [0.0, None], ids=["no grace", "the grace"])
def test_strangers_reconnecting_when_dropped_do_not_push_out_a_slow_peer_beside_them(
    served: tuple[Acceptor, _Lines, list[dict[str, Any]]], grace: float | None
) -> None:
    """A peer on the strangers' address that answers after 0.3 s (a loaded machine): each
    stranger it pushes out comes back and pushes out the next oldest, so without a grace
    the peer itself is dropped within milliseconds; with it, the peer is kept."""
    acceptor, _, hellos = served
    acceptor._cap = 8  # at most 4 from one address
    if grace is not None:
        acceptor._grace = grace
    port = _port(acceptor)
    with Holder([("127.0.0.1", port)], 4) as strangers:
        time.sleep(max(acceptor._grace, 0.1) + 0.1)  # the strangers' handshakes are old
        peer = socket.create_connection(("127.0.0.1", port), timeout=5)
        peer.recv(40, socket.MSG_PEEK)
        time.sleep(0.3)
        if grace == 0.0:
            with pytest.raises((ConnectionError, HandshakeError, OSError)):
                client_handshake(peer, SECRET, SCHEME, time.monotonic() + 5, {"name": "peer"})
            assert strangers.reopened >= 4  # each stranger once, then the peer
        else:
            client_handshake(peer, SECRET, SCHEME, time.monotonic() + 5, {"name": "peer"})
            deadline = time.monotonic() + 5
            while not hellos and time.monotonic() < deadline:
                time.sleep(0.01)
            assert hellos == [{"name": "peer"}]
        peer.close()


@pytest.mark.timeout(30)
def test_rejections_beyond_the_burst_are_counted_in_a_later_line(
    served: tuple[Acceptor, _Lines, list[dict[str, Any]]],
) -> None:
    acceptor, lines, _ = served
    acceptor.rejections = RejectionLog(lines, burst=1, every=1.0)
    port = _port(acceptor)
    for _ in range(6):
        with _connect(port) as sock:
            sock.sendall(b"\xff" * 36)  # a hello larger than allowed: rejected at once
            assert sock.recv(10) == b""
    assert len(lines.lines) == 1 and "rejected a connection from 127.0.0.1" in lines.lines[0]
    # no further rejection comes: the acceptor writes the count when its interval ends
    seen = lines.wait_for(lambda seen: len(seen) == 2, timeout=3)
    assert len(seen) == 2 and seen[1].startswith("rejected 5 more connections"), seen


def _client_in_thread(
    sock: socket.socket, secret: bytes
) -> tuple[threading.Thread, list[BaseException]]:
    """A client's handshake on ``sock`` in a thread; what it raised goes in the list."""
    errors: list[BaseException] = []

    def client() -> None:
        try:
            client_handshake(sock, secret, SCHEME, time.monotonic() + 5, {"name": "x"})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    return thread, errors


def test_a_wrong_secret_fails_on_both_sides() -> None:
    server = ServerHandshake(SECRET, SCHEME)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(server.greeting)
        thread, errors = _client_in_thread(b, b"wrong")
        a.settimeout(5)
        with pytest.raises(HandshakeError, match="client failed the HMAC challenge") as info:
            while server.feed(a.recv(server.wanted())) is None:
                pass
        a.sendall(info.value.reply)  # as the acceptor does before it closes
        a.close()
        thread.join(5)
    assert errors and "secrets differ" in str(errors[0]), errors


def test_a_server_that_closes_after_the_answer_is_going_away_not_a_wrong_secret() -> None:
    """The client cannot tell a shutdown from a rejection by the close alone: the server
    says which (an RPC peer that left right after init_rpc is not a secret mismatch)."""
    server = ServerHandshake(SECRET, SCHEME)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(server.greeting)
        thread, errors = _client_in_thread(b, SECRET)
        a.settimeout(5)
        while server.feed(a.recv(server.wanted())) is None:
            pass
        a.close()  # it had the answer, and left without sending its proof
        thread.join(5)
    assert errors and isinstance(errors[0], ConnectionResetError), errors
    assert "shutting down" in str(errors[0]) and "secrets" not in str(errors[0])
