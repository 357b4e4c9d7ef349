"""This process's gloo connections, found through ``/proc``, and how to cut them.

gloo has no working abort (pytorch#130345): a collective fails only when one of its own
connections does. Each gloo device runs an event loop over an epoll set of one wake-up
pipe, a listening TCP socket and its connected sockets; those connected sockets are what
:func:`loops` finds, per loop. :func:`shut_down` shuts sockets down (never closes them:
gloo owns the descriptors), which fails every peer blocked on them at once. Linux only;
elsewhere nothing is found.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = [
    "device_connections",
    "epoll_sets",
    "listens",
    "loops",
    "release",
    "shut_down",
    "socket_links",
    "tcp_table",
    "unix_sockets",
]

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
EPOLL, PIPE, OTHER = -1, -2, 0


def socket_links() -> dict[int, int]:
    """``{fd: inode}`` of this process's sockets, epoll sets as :data:`EPOLL`, pipes as
    :data:`PIPE`, anything else as :data:`OTHER`."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
        elif link == "anon_inode:[eventpoll]":
            out[int(name)] = EPOLL
        elif link.startswith("pipe:["):
            out[int(name)] = PIPE
        else:
            out[int(name)] = OTHER
    return out


def tcp_table() -> dict[int, tuple[int, str]]:
    """``{inode: (remote port, state)}`` of every TCP socket the kernel lists."""
    out: dict[int, tuple[int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fp:
                lines = fp.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9].isdigit():
                out[int(fields[9])] = (int(fields[2].rsplit(":", 1)[1], 16), fields[3])
    return out


def unix_sockets() -> frozenset[int]:
    """The inodes of the Unix sockets the kernel lists (a TCP socket that a peer reset is no
    longer in :func:`tcp_table`: it is told from a Unix socket by not being here)."""
    try:
        with open("/proc/net/unix") as fp:
            lines = fp.read().splitlines()[1:]
    except OSError:
        return frozenset()
    return frozenset(int(f[6]) for f in map(str.split, lines) if len(f) > 6 and f[6].isdigit())


def _watched(epoll_fd: int, links: dict[int, int]) -> list[tuple[int, int]]:
    """``(fd, inode)`` of each file epoll set ``epoll_fd`` watches. The inode is the one
    the registration names, not that of whatever the fd number holds now: a watched socket
    that another thread closed meanwhile (gloo, when its peer hung up) gave its number to
    the next socket made, a TCPStore client's or a new device's, which must not be taken
    for it. Without an ``ino:`` field (old kernels), the fd table's inode."""
    try:
        with open(f"/proc/self/fdinfo/{epoll_fd}") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if not line.startswith("tfd:"):
            continue
        fd = int(line.split()[1])
        found = [f[4:] for f in line.split() if f.startswith("ino:")]
        out.append((fd, int(found[0], 16) if found else links.get(fd, OTHER)))
    return out


def loops(
    links: dict[int, int] | None = None, tcp: dict[int, tuple[int, str]] | None = None
) -> dict[int, frozenset[int]]:
    """``{epoll fd: inodes of its connected sockets}`` for every gloo device loop."""
    links = socket_links() if links is None else links
    tcp = tcp_table() if tcp is None else tcp
    unix = unix_sockets()
    found: dict[int, frozenset[int]] = {}
    for fd, inode in links.items():
        if inode != EPOLL:
            continue
        # a socket is known by its registration's inode (see _watched), the rest by kind
        kinds = [ino if links.get(t, OTHER) > 0 else links.get(t, OTHER)
                 for t, ino in _watched(fd, links)]  # fmt: skip
        if kinds.count(PIPE) != 1 or any(k in (OTHER, EPOLL) for k in kinds):
            continue  # not one wake-up pipe, or something else than sockets
        sockets = [k for k in kinds if k > 0]
        if any(k in unix for k in sockets) or not _listening(sockets, tcp):
            continue  # a Unix socket (asyncio's self-pipe), or no listener
        # every socket but the listener, those a dead peer reset too (the kernel lists them
        # no more; shutting one down does nothing): the loop is still a gloo device's
        found[fd] = frozenset(k for k in sockets if tcp.get(k, (0, ""))[1] != LISTEN)
    return found


def _listening(inodes: list[int], tcp: dict[int, tuple[int, str]]) -> bool:
    return any(k > 0 and tcp.get(k, (0, ""))[1] == LISTEN for k in inodes)


def _connected(inodes: list[int], tcp: dict[int, tuple[int, str]]) -> frozenset[int]:
    return frozenset(k for k in inodes if k > 0 and k in tcp and tcp[k][1] != LISTEN)


def epoll_sets(links: dict[int, int] | None = None) -> set[int]:
    """This process's epoll descriptors (a new gloo device adds one: its loop's)."""
    links = socket_links() if links is None else links
    return {fd for fd, inode in links.items() if inode == EPOLL}


def device_connections(
    epoll_fd: int,
    links: dict[int, int] | None = None,
    tcp: dict[int, tuple[int, str]] | None = None,
) -> frozenset[int]:
    """The inodes of the connected TCP sockets that epoll set ``epoll_fd`` watches now (a
    gloo device's loop: its pairs' sockets, not its listener)."""
    links = socket_links() if links is None else links
    tcp = tcp_table() if tcp is None else tcp
    return _connected([ino for _, ino in _watched(epoll_fd, links)], tcp)


def listens(epoll_fd: int, links: dict[int, int] | None = None) -> bool:
    """Whether epoll set ``epoll_fd`` watches a listening TCP socket (a gloo device's)."""
    links = socket_links() if links is None else links
    return _listening([ino for _, ino in _watched(epoll_fd, links)], tcp_table())


def shut_down(
    inodes: frozenset[int] | set[int],
    links: dict[int, int] | None = None,
    *,
    how: int = socket.SHUT_RDWR,
    hold: list[socket.socket] | None = None,
) -> int:
    """Shut down (``how``) this process's sockets whose inode is in ``inodes``; returns how
    many. With ``hold``, a duplicate of each is kept open there: when gloo closes its own
    descriptor, the socket stays open (no FIN or reset to the peer) until ``hold`` is
    closed (:func:`release`)."""
    links = socket_links() if links is None else links
    done = 0
    for fd, inode in links.items():
        if inode <= 0 or inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            copy = os.dup(fd)
            if os.fstat(copy).st_ino != inode:  # closed since it was listed; its number
                os.close(copy)  # taken by another socket, which is none of ours to cut
                continue
            dup = socket.socket(fileno=copy)
            kept = False
            try:
                dup.shutdown(how)
                done += 1
                if hold is not None:
                    hold.append(dup)
                    kept = True
            finally:
                if not kept:
                    dup.close()
    return done


def release(held: list[socket.socket]) -> None:
    """Close the sockets :func:`shut_down` held, and empty ``held``."""
    while held:
        with contextlib.suppress(OSError):
            held.pop().close()
