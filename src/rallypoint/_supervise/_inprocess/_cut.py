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

from rallypoint._core.gloo_links import LISTEN, loops, shut_down, socket_links, tcp_table

__all__ = ["cut_attempt", "sockets_now"]


def sockets_now() -> frozenset[int]:
    """The inodes of this process's sockets."""
    return frozenset(inode for inode in socket_links().values() if inode > 0)


def cut_attempt(since: frozenset[int], store_port: int | None) -> int:
    """Shut down this process's ends of the attempt's gloo and store connections made
    since ``since`` (:func:`sockets_now`); returns how many."""
    links = socket_links()
    tcp = tcp_table()
    targets: set[int] = set().union(*loops(links, tcp).values())
    if store_port:
        targets.update(
            inode
            for inode in links.values()
            if inode in tcp and tcp[inode][0] == store_port and tcp[inode][1] != LISTEN
        )
    return shut_down(targets - since, links)
