"""Ports: free ones now, one held for a server to come, whether an explicit one is free, a
wait for one to listen; the address towards a host."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "await_listener",
    "free_port",
    "free_ports",
    "local_address_towards",
    "port_is_free",
    "reserved_port",
]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    The port is only reserved until this function returns; callers that can bind port 0
    themselves (TCPStore can) should do that instead. It is picked below the kernel's
    range for outgoing connections' local ports where there is room, so no connection
    made meanwhile takes it (:func:`free_ports`).
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now.

    A port that port 0 gives is one the kernel also hands to outgoing connections as
    their local port: any process's connect between this return and the caller's bind
    can take it (a test's store then failed with "already in use" on a loaded machine).
    So ports are drawn at random below that range (``ip_local_port_range``, Linux) and
    bound without ``SO_REUSEADDR`` (a port in ``TIME_WAIT`` or held by
    :func:`reserved_port` is passed over), with port 0 as the fallback. Every probe stays
    bound until all ports are picked, so they differ.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    below = _below_outgoing_ports()
    probes: list[socket.socket] = []
    try:
        for port in random.sample(below, min(len(below), 50 * count)):
            if len(probes) == count:
                break
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            probes.append(sock)
        while len(probes) < count:
            sock = socket.socket(family, socket.SOCK_STREAM)
            probes.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in probes]
    finally:
        for sock in probes:
            sock.close()


def _below_outgoing_ports() -> range:
    """Ports under the kernel's range for outgoing connections (from 10000, so that the
    well-known and registered ports of common services stay out), or none."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(10_000, low) if low > 11_000 else range(0)


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


def await_listener(
    host: str,
    port: int,
    deadline: float,
    *,
    every: float = 0.1,
    pause: Callable[[float], object] = time.sleep,
    give_up: Callable[[], bool] = lambda: False,
) -> str:
    """Until something at ``host:port`` takes a TCP connection (``""``), ``deadline``
    (``time.monotonic()``) passes or ``give_up()`` says so: then why the last try failed
    ("connection refused", "no answer (...)"). A plain socket, tried from Python: c10d's
    TCPStore client retries a refused connect in C++, deaf to signals and past its own
    timeout. ``pause(every)`` runs between tries (an ``Event.wait`` ends them early)."""
    why = "not tried"
    while not give_up():
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), port), max(0.05, min(1.0, left))):
                return ""
        except ConnectionRefusedError:
            why = "connection refused"
        except OSError as exc:
            why = f"no answer ({exc.strerror or type(exc).__name__})"
        if time.monotonic() + every >= deadline:
            break
        pause(every)
    return why
