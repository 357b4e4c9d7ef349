"""Cutting an interrupted attempt's connections, so that no rank stays blocked in it.

gloo has no working abort: a collective fails only when one of its own connections does,
so a survivor waiting on another survivor stays blocked. A worker told to leave shuts down
the reading side of its own end of the attempt's gloo connections (the TCP sockets a gloo
device's epoll loop watches) and store connections (TCP to ``MASTER_PORT``), made since the
function was entered: every read of this worker ends, so each collective and store wait it
is in fails, and every worker cuts its own: every position is freed. Each cut socket is
held open until the next attempt (:func:`release`), so the cut sends the peer nothing
(why: :func:`cut_attempt`). Linux only (``/proc``).
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
    until :func:`release`; returns how many.

    Only reads, and held open: gloo loses a send that a pair failed to write (``EPIPE``:
    our end shut down for writing, or the peer's end closed or reset) if the pair fails
    before its event loop wrote it (``Pair::signalException`` signals queued sends only for
    bound buffers), and the collective then waits its whole timeout in ``waitSend``. A cut
    of both sides, or a peer whose gloo closed a cut socket (a FIN, then a reset), made such
    sends whenever a collective wrote before its loop had seen the cut: seen under heavy
    load, a rank of an 8-rank DDP job stuck in ``loss.backward()``."""
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
