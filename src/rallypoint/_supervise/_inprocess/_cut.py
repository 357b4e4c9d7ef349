"""Cutting an interrupted attempt's connections, so that no rank stays blocked in it.

gloo has no working abort: a collective fails only when one of its own connections does,
so a survivor waiting on another survivor (or in its ``destroy_process_group``, which
joins gloo's threads) stays blocked. A worker told to leave shuts down (never closes: gloo
owns them) its own end of the attempt's gloo connections (the TCP sockets a gloo device's
epoll loop watches: one wake-up pipe, a listening socket, the connected ones) and store
connections (TCP to ``MASTER_PORT``; a store wait ignores signals). Only sockets made since
the function was entered are cut; nothing that is not TCP. Each peer blocked on a cut
connection fails at once, and every worker cuts its own: every position is freed. Linux
only (``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["cut_attempt", "sockets_now"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def sockets_now() -> frozenset[int]:
    """The inodes of this process's sockets."""
    return frozenset(inode for inode in _links().values() if inode > 0)


def _links() -> dict[int, int]:
    """``{fd: socket inode}`` for this process's sockets (inode ``0``: not a socket, with
    epoll sets as ``-1``)."""
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
            out[int(name)] = -1
        elif link.startswith("pipe:["):
            out[int(name)] = -2
    return out


def _tcp() -> dict[int, tuple[int, str]]:
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


def _watched(epoll_fd: int) -> list[int]:
    """The descriptors an epoll set watches (``tfd`` lines of its fdinfo)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll_fd}") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return []
    return [int(line.split()[1]) for line in lines if line.startswith("tfd:")]


def _gloo_sockets(links: dict[int, int], tcp: dict[int, tuple[int, str]]) -> set[int]:
    """Connected sockets of gloo devices' event loops (see the module docstring)."""
    found: set[int] = set()
    for fd, inode in links.items():
        if inode != -1:
            continue
        watched = _watched(fd)
        kinds = [links.get(t, 0) for t in watched]
        if kinds.count(-2) != 1 or any(k == 0 or k == -1 for k in kinds):
            continue  # not one wake-up pipe, or something else than sockets
        sockets = [k for k in kinds if k > 0]
        if any(k not in tcp for k in sockets):
            continue  # a Unix socket (asyncio's self-pipe, say)
        if not any(tcp[k][1] == _LISTEN for k in sockets):
            continue
        found.update(k for k in sockets if tcp[k][1] != _LISTEN)
    return found


def cut_attempt(since: frozenset[int], store_port: int | None) -> int:
    """Shut down this process's ends of the attempt's gloo and store connections made
    since ``since`` (:func:`sockets_now`); returns how many."""
    links = _links()
    tcp = _tcp()
    targets = _gloo_sockets(links, tcp)
    if store_port:
        targets.update(
            inode
            for inode in links.values()
            if inode in tcp and tcp[inode][0] == store_port and tcp[inode][1] != _LISTEN
        )
    targets -= since
    cut = 0
    for fd, inode in links.items():
        if inode not in targets:
            continue
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=os.dup(fd))
            try:
                dup.shutdown(socket.SHUT_RDWR)
                cut += 1
            finally:
                dup.close()
    return cut
