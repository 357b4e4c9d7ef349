"""Finding a gloo device's loop through ``/proc`` (``_core.gloo_links.loops``).

A loop is an epoll set over one wake-up pipe, a listening TCP socket and connected TCP
sockets, as gloo's device builds it; the tests build one with ``select.epoll``. A peer that
dies with data unread resets its connection, and the kernel then lists that socket no more
in ``/proc/net/tcp``: the loop must still be found (its other connections are what frees the
ranks blocked on live peers), while an epoll set over a Unix socket (asyncio's) is not one.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from rallypoint._core.gloo_links import device_connections, loops, release, shut_down, tcp_table

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/fdinfo"), reason="Linux only")


def _inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


class _Loop:
    """An epoll set as a gloo device's: a wake-up pipe, a listener, accepted connections."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.pipe = os.pipe()
        self.epoll.register(self.pipe[0], select.EPOLLIN)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self.mine: list[socket.socket] = []
        self.peers: list[socket.socket] = []

    def connect(self) -> socket.socket:
        peer = socket.create_connection(self.listener.getsockname())
        mine, _ = self.listener.accept()
        self.epoll.register(mine.fileno(), select.EPOLLIN)
        self.mine.append(mine)
        self.peers.append(peer)
        return mine

    def close(self) -> None:
        for s in (*self.mine, *self.peers, self.listener):
            s.close()
        os.close(self.pipe[0])
        os.close(self.pipe[1])
        self.epoll.close()


@pytest.fixture
def loop() -> Iterator[_Loop]:
    made = _Loop()
    yield made
    made.close()


@pytest.mark.timeout(30)
def test_a_loop_is_found_with_its_connections(loop: _Loop) -> None:
    a, b = loop.connect(), loop.connect()
    assert loops()[loop.epoll.fileno()] == {_inode(a), _inode(b)}


@pytest.mark.timeout(30)
def test_a_loop_whose_peer_reset_a_connection_is_still_found(loop: _Loop) -> None:
    live, reset = loop.connect(), loop.connect()
    reset.sendall(b"x" * 64)  # unread by the peer, which then goes: the kernel resets it
    peer = loop.peers[1]
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()
    deadline = time.monotonic() + 5
    while _inode(reset) in tcp_table():
        assert time.monotonic() < deadline, "the reset socket is still listed"
        time.sleep(0.01)
    assert _inode(live) in loops()[loop.epoll.fileno()]  # a dropped loop cut nothing


@pytest.mark.timeout(30)
def test_a_socket_that_took_a_watched_sockets_number_is_not_taken_for_it(loop: _Loop) -> None:
    """gloo closes a connection whose peer hung up while another thread opens a socket (a
    TCPStore client's, a new device's), which gets the freed number: an abort that read the
    epoll set's numbers, then the fd table, cut that stranger (seen as a new communicator's
    "Connection closed by peer" in torchft's resiliency cases). The epoll set names the file
    it watches; here it stays watched (a duplicate keeps it open) as its number is reused."""
    watched = loop.connect()
    number, kept = watched.fileno(), os.dup(watched.fileno())
    other = _Loop()
    try:
        stranger = other.connect()
        watched.close()
        os.dup2(stranger.fileno(), number)  # the freed number now holds the stranger
        epoll = loop.epoll.fileno()
        assert device_connections(epoll) == {os.fstat(kept).st_ino}
        assert loops()[epoll] == {os.fstat(kept).st_ino}
        listed_before = {number: os.fstat(kept).st_ino}  # the fd table read before the reuse
        assert shut_down({os.fstat(kept).st_ino}, listed_before) == 0
        assert shut_down(device_connections(epoll)) == 1  # the watched one, through ``kept``
        stranger.sendall(b"still connected")
        assert other.peers[0].recv(64) == b"still connected"
    finally:
        os.close(number)
        os.close(kept)
        other.close()


@pytest.mark.timeout(30)
def test_an_epoll_set_over_a_unix_socket_is_no_gloo_loop(loop: _Loop) -> None:
    loop.connect()
    left, right = socket.socketpair()
    try:
        loop.epoll.register(left.fileno(), select.EPOLLIN)
        assert loop.epoll.fileno() not in loops()
    finally:
        left.close()
        right.close()


@pytest.mark.timeout(30)
def test_a_held_read_cut_ends_our_reads_and_tells_the_peer_nothing_until_released(
    loop: _Loop,
) -> None:
    """What the in-process cut does: our reads end; our writes still go; the peer sees no
    end (its writes are not reset) even once the owner closed its descriptor, as gloo does
    after the failed read, until the held duplicate is released."""
    mine = loop.connect()
    peer = loop.peers[0]
    held: list[socket.socket] = []
    assert shut_down({_inode(mine)}, how=socket.SHUT_RD, hold=held) == 1
    assert mine.recv(1) == b""
    mine.sendall(b"ours")
    assert peer.recv(4) == b"ours"
    loop.epoll.unregister(mine.fileno())
    mine.close()
    peer.setblocking(False)
    for _ in range(3):
        peer.sendall(b"x")  # queued at our end: no reset
        time.sleep(0.05)
    with pytest.raises(BlockingIOError):
        peer.recv(1)  # no end seen
    release(held)
    assert held == []
    deadline = time.monotonic() + 5
    while True:
        try:
            peer.recv(1)
            break  # the end (or the reset of our unread bytes)
        except BlockingIOError:
            assert time.monotonic() < deadline, "the peer never saw the end"
            time.sleep(0.01)
        except ConnectionResetError:
            break
