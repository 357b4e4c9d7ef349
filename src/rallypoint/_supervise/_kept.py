"""The workers this node keeps between attempts, in one owner: those an in-process restart
parked (or a hot spare started ahead), by local rank, and the spare workers that wait for
a rank (``_inprocess._spares``). The next attempt takes them (:meth:`KeptWorkers.take`);
a restart that will not come stops them (:meth:`KeptWorkers.stop`)."""

from __future__ import annotations

import signal
from collections.abc import Iterable

from rallypoint._supervise._inprocess._spares import SparePool
from rallypoint._supervise._state import Worker
from rallypoint._supervise._stop import Stopper
from rallypoint._supervise._warm._exits import ExitReports

__all__ = ["KeptWorkers"]


class KeptWorkers:
    """This node's parked workers and its spare pool (:attr:`spares`)."""

    def __init__(self, spares: SparePool, *, stopper: Stopper, exits: ExitReports) -> None:
        self.spares = spares
        self.stopper, self.exits = stopper, exits
        self._parked: dict[int, Worker] = {}
        """Workers parked by the last attempt for an in-process restart, by local rank."""

    @property
    def parked(self) -> bool:
        """Whether workers wait for the next attempt's ranks (the spares aside)."""
        return bool(self._parked)

    def park(self, workers: Iterable[Worker]) -> None:
        """Keep ``workers`` for the next attempt, in place of those kept before."""
        self._parked = {w.local_rank: w for w in workers}

    def take(self, nproc: int, attempt: int) -> tuple[dict[int, Worker], set[int]]:
        """What attempt ``attempt`` gets, by local rank: the parked workers still alive and,
        for ranks left, spares whose set-up is done (``SparePool.place``); and the ranks
        that spares took. None of them is kept here any more."""
        kept, self._parked = self._alive(self._parked), {}
        return kept, self.spares.place(kept, nproc, attempt)

    def _alive(self, kept: dict[int, Worker]) -> dict[int, Worker]:
        """``kept`` but the workers that exited since (a hot spare's set-up that failed, a
        parked worker killed): those are started afresh."""
        if not kept and not self.spares.waiting:
            return kept
        self.exits.read()  # a spare's exit too, for the pool
        for local_rank, w in list(kept.items()):
            if self.exits.pop(w.pid) is not None:
                del kept[local_rank]
                w.close_channels()
        return kept

    def stop(self) -> None:
        """Stop every kept worker, as workers are stopped: SIGTERM (their handlers run),
        SIGKILL after ``--shutdown-timeout``. Spares hold no rank and no state: they are
        killed at once (a spare's SIGTERM handler, a checkpoint on preemption say, has
        nothing to save)."""
        spares = self.spares.take_all()
        if spares:
            self.stopper.kill_trees(spares, signal.SIGKILL)
            self.stopper.wait_all(spares, 5.0)
            for w in spares:
                w.close_channels()
        kept, self._parked = list(self._parked.values()), {}
        if not kept:
            return
        self.stopper.kill_trees(kept, signal.SIGTERM)
        self.stopper.wait_all(kept, self.stopper.grace)
        self.stopper.kill_trees(kept, signal.SIGKILL)
        self.stopper.wait_all(kept, 5.0)
        for w in kept:
            w.close_channels()
