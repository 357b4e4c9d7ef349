"""Ports: free ones now, one held for a server to come, whether an explicit one is free; the
address towards a host."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["free_port", "free_ports", "local_address_towards", "port_is_free", "reserved_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    The port is only reserved until this function returns; callers that can bind port 0
    themselves (TCPStore can) should do that instead.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now.

    Calling :func:`free_port` twice can return the same port: the kernel may hand out a
    port again as soon as the probe socket closes. Here every probe stays bound until all
    ports are picked, so they differ.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probes: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            probes.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in probes]
    finally:
        for sock in probes:
            sock.close()


@contextlib.contextmanager
def reserved_port(host: str = "0.0.0.0") -> Iterator[int]:
    """A TCP port that stays out of everyone else's reach while the block runs, for a
    server that another process starts later (a worker's TCPStore at ``MASTER_PORT``).

    :func:`free_port`'s port is free only until it returns: another process's ``bind`` to
    port 0, or its outgoing connection's local port, can take it before the server binds
    it, and the server then fails with ``EADDRINUSE`` while its clients wait out their
    connect timeout. Here the probe stays bound (with ``SO_REUSEADDR``, never listening):
    the kernel hands the port to no ``bind`` to port 0 and no ``connect``, and refuses a
    ``bind`` without ``SO_REUSEADDR``, while a server that sets ``SO_REUSEADDR`` (c10d's
    TCPStore, either backend) binds and listens beside it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """Whether ``port`` can be bound on ``host`` (used to reject a busy explicit port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def local_address_towards(host: str) -> str:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent);
    ``127.0.0.1`` when there is no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
