"""Stopping workers: whole process trees, with a grace period, and no orphans.

Each worker leads its own session, so ``killpg`` reaches what it started in its session;
anything that left the session is still a descendant of the warm process (a child
subreaper), so it is found through ``psutil`` and signalled too. The store process and the
snapshot server, also children of the warm process, are never signalled with the workers.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Sequence
from datetime import timedelta

import psutil

from rallypoint._supervise._state import Worker
from rallypoint._supervise._warm._exits import ExitReports
from rallypoint._supervise._warm._notices import WRITER_NAME
from rallypoint._supervise._warm._process import WarmProcess

__all__ = ["INTERRUPT_GRACE", "QUICK_GRACE", "Stopper"]

QUICK_GRACE = 3.0
"""Seconds of grace for workers stopped because of a hang or a restart: they are likely
blocked in a collective, so waiting the whole ``shutdown_timeout`` would only delay."""
INTERRUPT_GRACE = 4.0
"""Seconds of grace for workers stopped by a Ctrl-C (SIGINT): a job stops within 5 s of
one, as under torchrun, whatever ``shutdown_timeout`` says (it is the grace of a SIGTERM,
a preemption's)."""


class Stopper:
    """Signals the workers of one warm process and says when to escalate to SIGKILL."""

    def __init__(self, warm: WarmProcess, shutdown_timeout: timedelta, exits: ExitReports) -> None:
        self.warm = warm
        self.exits = exits
        self.grace = shutdown_timeout.total_seconds()
        self.store_pid = 0
        self.snapshot_pid = 0
        self.spare_pids: set[int] = set()
        """Pids of the spare workers that wait for a rank: left alone unless targeted.
        Set by the spare pool alone (``_inprocess._spares``)."""

    def stop(
        self,
        workers: Sequence[Worker],
        signum: int,
        *,
        quick: bool = False,
        spare: Sequence[Worker] = (),
    ) -> float:
        """Send ``signum`` to every worker's tree (but ``spare``'s); returns when to send
        SIGKILL: ``shutdown_timeout`` from now, at most :data:`QUICK_GRACE` when ``quick``,
        :data:`INTERRUPT_GRACE` for a SIGINT."""
        for w in workers:
            if w.status is None and w.signalled is None:
                w.signalled = signum
        self.kill_trees(workers, signum, spare=spare)
        grace = min(self.grace, QUICK_GRACE) if quick else self.grace
        if signum == signal.SIGINT:
            grace = min(grace, INTERRUPT_GRACE)
        return time.monotonic() + grace

    def kill_trees(
        self, workers: Sequence[Worker], signum: int, *, spare: Sequence[Worker] = ()
    ) -> None:
        """Send ``signum`` once to every process of the workers' trees: each worker's
        session by ``killpg``, then whatever left it (a handler that runs twice because
        it was signalled twice could cut its own checkpoint short). The trees of ``spare``
        (workers kept for an in-process restart) are left alone."""
        kept = {w.pid for w in spare if w.status is None}
        kept |= self.spare_pids - {w.pid for w in workers}
        groups = set()
        for w in workers:
            if w.pid in kept:
                continue
            with contextlib.suppress(OSError):
                os.killpg(w.pid, signum)
                groups.add(w.pid)
        kept_trees = set(kept)
        for pid in kept:
            with contextlib.suppress(psutil.Error):
                kept_trees.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        for p in self._descendants():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid in kept_trees or os.getpgid(p.pid) in kept:
                    continue
                if os.getpgid(p.pid) not in groups:
                    p.send_signal(signum)

    def _descendants(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.warm.pid).children(recursive=True)
        except psutil.Error:
            return []
        skip = {self.store_pid, self.snapshot_pid} - {0}
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.pid in skip or p.ppid() in skip or p.name() == WRITER_NAME:
                    continue  # (a notice of a replica group's death is written to its end)
                out.append(p)
        return out

    def wait_all(self, workers: Sequence[Worker], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the warm process to report every exit."""
        end = time.monotonic() + timeout
        while any(w.status is None for w in workers) and time.monotonic() < end:
            with selectors.DefaultSelector() as sel:
                sel.register(self.exits.fileno(), selectors.EVENT_READ)
                sel.select(0.05)
            self.exits.read()
            for w in workers:
                status = self.exits.pop(w.pid)
                if status is not None:
                    w.status = status
