"""Cutting an interrupted attempt's connections, so that no rank stays blocked in it.

gloo has no working abort: a collective fails only when one of its own connections does,
so a survivor waiting on another survivor (or in its ``destroy_process_group``, which
joins gloo's threads) stays blocked. A worker told to leave shuts down (never closes: gloo
owns them) the reading side of its own end of the attempt's gloo connections (the TCP
sockets a gloo device's epoll loop watches: one wake-up pipe, a listening socket, the
connected ones) and store connections (TCP to ``MASTER_PORT``; a store wait ignores
signals). Only sockets made since the function was entered are cut; nothing that is not
TCP. Each of this worker's reads then ends at once, so every collective and store wait it
is in fails, and every worker cuts its own: every position is freed. Linux only
(``/proc``).

Only reads, and each cut socket is held open (a duplicate, in ``held``) until the next
attempt is assigned (:func:`release`): the cut sends nothing to the peer. gloo loses a
send that a pair failed to write (``EPIPE``: our end was shut down for writing, or the
peer's end was closed or reset) if the pair fails before its event loop has written it
(``Pair::signalException`` signals the sends it queued only for bound buffers): the
collective then waits its whole timeout (30 min by default) in ``waitSend``. A cut that
shut down both sides, or a peer whose gloo closed a cut socket (a FIN, a reset on the
next write), made such sends whenever a collective wrote on a connection before its loop
had seen the cut: seen under heavy load, a rank of an 8-rank DDP job stuck in
``loss.backward()``, its gloo thread in ``UnboundBuffer::waitSend``.
"""

from __future__ import annotations

import socket

from rallypoint._core.gloo_links import LISTEN, loops, release, shut_down, socket_links, tcp_table

__all__ = ["cut_attempt", "release", "sockets_now"]


def sockets_now() -> frozenset[int]:
    """The inodes of this process's sockets."""
    return frozenset(inode for inode in socket_links().values() if inode > 0)


def cut_attempt(since: frozenset[int], store_port: int | None, held: list[socket.socket]) -> int:
    """Shut down the reading side of this process's ends of the attempt's gloo and store
    connections made since ``since`` (:func:`sockets_now`), each kept open in ``held``
    until :func:`release`; returns how many."""
    links = socket_links()
    tcp = tcp_table()
    targets: set[int] = set().union(*loops(links, tcp).values())
    if store_port:
        targets.update(
            inode
            for inode in links.values()
            if inode in tcp and tcp[inode][0] == store_port and tcp[inode][1] != LISTEN
        )
    return shut_down(targets - since, links, how=socket.SHUT_RD, hold=held)
