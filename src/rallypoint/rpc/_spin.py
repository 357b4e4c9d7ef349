"""Busy-polling for a reply: when a thread in ``rpc_sync`` spins, and the spin itself.

A thread that reads its own reply (see :mod:`rallypoint.rpc._transport`) may poll the
socket without sleeping for a while first. On a machine with spare cores that saves the
wake-up of the calling thread, about half of a small call's round trip on a VM. On a
busy machine it steals the CPU the replying process needs, and for slow calls it only
burns CPU; :class:`SpinPolicy` stops spinning for a while in both cases.
"""

from __future__ import annotations

import select
import time


class SpinPolicy:
    """Whether a caller busy-polls for its reply: yes, unless spinning failed lately.

    A spin fails when the reply did not come within the window, or when the spinning
    thread lost its CPU meanwhile (another process wanted it: the machine is busy, and
    spinning would slow the very process that is to reply). After a failure the next
    calls sleep, twice as many after each further failure (up to ``MAX_SKIP``), half as
    many after a spin that works: spinning goes on while most spins work.
    """

    MAX_SKIP = 256

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._skip = 0
        self._penalty = 1

    def choose(self) -> bool:
        if not self.window_s:
            return False
        if self._skip:
            self._skip -= 1
            return False
        return True

    def record(self, worked: bool) -> None:
        if worked:
            self._penalty = max(1, self._penalty // 2)
            return
        self._skip = self._penalty
        self._penalty = min(2 * self._penalty, self.MAX_SKIP)


def spin_for_frame(poller: select.poll, until: float) -> bool:
    """Poll without sleeping until the socket is readable or ``until`` (``perf_counter``)
    passes; whether it became readable in time with this thread on a CPU all along."""
    poll = poller.poll
    clock = time.perf_counter
    cpu0, wall0 = time.thread_time(), clock()
    while not poll(0):
        if clock() >= until:
            return False
    wall = clock() - wall0
    return time.thread_time() - cpu0 >= 0.8 * wall
