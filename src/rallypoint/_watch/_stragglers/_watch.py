"""One attempt's straggler detection on one node: sample, exchange, judge, report.

The policy of an attempt calls :meth:`StragglerWatch.tick` (one node) or
:meth:`StragglerWatch.exchange` (a node of a multi-node job) from its monitor tick; every
period the node samples its progress board and summarises its ranks' step times as a
:class:`NodePace`. Across nodes every node writes its summary to the run store and only
group rank 0 reads them all and judges the whole job, so a rank or node is reported once,
on that node's screen and in its ``--events`` file. A summary that stopped moving (the
node finished or is gone) no longer counts. The judge prints a line when a rank or node
becomes slow and writes ``straggler`` and ``step_times`` events.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from rallypoint._core.ranks import ranks_text
from rallypoint._core.store import Store
from rallypoint._watch._stragglers._arrival_watch import ArrivalWatch, TraceRequest
from rallypoint._watch._stragglers._exchange import Freshness, read_present
from rallypoint._watch._stragglers._pace import (
    WINDOW_S,
    NodePace,
    PaceWindow,
    RankPace,
    Straggler,
    StragglerDetector,
    median,
    pace_every,
)
from rallypoint.observe import ProgressBoard

__all__ = [
    "STEP_LOG_EVERY",
    "StragglerWatch",
    "pace_key",
]

STEP_LOG_EVERY = 10.0
"""Least seconds between two ``step_times`` events (the window, when that is shorter)."""


def pace_key(round: int, group_rank: int) -> str:
    """The run-store key of a node's summary in round ``round``."""
    return f"pace/{round}/{group_rank}"


def _to_stderr(line: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(line)
        sys.stderr.flush()


def describe(change: Straggler, threshold: float) -> str:
    """The screen line for a rank or node that became slow."""
    if change.scope == "rank":
        who, others = f"rank {change.key} on {change.host}", "the other ranks"
    else:
        who = f"node {change.key} ({change.host}, {ranks_text(list(change.ranks))})"
        others = "the other nodes"
    return (
        f"rallypoint: straggler: {who} takes {change.step_s:.3g} s per step, "
        f"{change.ratio:.1f}x the median of {others} ({change.median_s:.3g} s; "
        f"--straggler-threshold {threshold:g})\n"
    )


class StragglerWatch:
    """Straggler detection for one attempt (round) of one node.

    Every node ``set``-s its summary under ``pace/<round>/<group rank>`` in the run store
    (the connection the agent's monitor loop uses for stack requests); the judge reads them
    with one ``check`` and one ``multi_get`` per period. A summary whose ``seq`` did not
    change for ``_exchange.STALE_AFTER`` periods no longer counts. A ``step_times`` event
    goes out at most every :data:`STEP_LOG_EVERY` seconds (``rallypoint report`` draws a
    lane per rank).

    ``emit`` writes an event (``Observer.emit``), ``say`` a line on the screen.
    ``arrivals``: asks this node's workers, given ``{rank: pid}``, for their Flight Recorder
    traces; with it, lock-step stragglers are found by arrival (``_arrival_watch``), and
    ``clock_store`` opens the store connection its clock responder blocks on;
    ``started_ns``, the attempt's start (``time.time_ns()``), keeps the collectives of an
    earlier attempt out of the comparison. :meth:`close` at the end of the attempt.
    """

    def __init__(
        self,
        board: ProgressBoard,
        *,
        threshold: float,
        host: str,
        round: int,
        rank_offset: int,
        emit: Callable[..., Any],
        say: Callable[[str], None] = _to_stderr,
        group_rank: int = 0,
        nnodes: int = 1,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        arrivals: Callable[[Mapping[int, int]], TraceRequest] | None = None,
        clock_store: Callable[[], Store] | None = None,
        started_ns: int | None = None,
    ) -> None:
        self.board = board
        self.detector = StragglerDetector(threshold)
        self.host = host
        self.round = round
        self.rank_offset = rank_offset
        self.group_rank = group_rank
        self.nnodes = nnodes
        self.every = pace_every(window_s)
        self.window = PaceWindow(board.nslots, window_s=window_s)
        self._emit = emit
        self._say = say
        self._clock = clock
        self._next = clock() + self.every
        self._next_log = 0.0
        self._seq = 0
        self._freshness = Freshness(self.every, clock)
        # a sample costs each worker a dump of its whole Flight Recorder (~40 ms of CPU
        # with 2000 entries): every sixth of the window is enough for the arrivals in it
        self.arrivals_every = max(self.every, window_s / 6)
        self.arrivals = None if arrivals is None else ArrivalWatch(
            arrivals,
            threshold=threshold,
            recover_at=self.detector.recover_at,
            host=host,
            round=round,
            group_rank=group_rank,
            nnodes=nnodes,
            window_s=window_s,
            every=self.arrivals_every - self.every / 2,  # asked on the due tick
            emit=emit,
            say=say,
            clock=clock,
            clock_store=clock_store,
            since_ns=started_ns,
        )  # fmt: skip

    # ------------------------------------------------------------------ entry points
    def tick(self, running: Collection[int]) -> None:
        """One node on its own: judge its ranks every ``every`` seconds."""
        if self.arrivals is not None:
            self.arrivals.read(running)
        if self._due():
            self._judge([self.local_pace(running)])
            if self.arrivals is not None:
                self.arrivals.ask(running)

    def exchange(self, store: Store, running: Collection[int]) -> None:
        """A node of a multi-node job: publish this node's summary every ``every`` seconds;
        the node with group rank 0 also reads every node's and judges the job."""
        if self.arrivals is not None:
            self.arrivals.read(running, store)
        if not self._due():
            return
        pace = self.local_pace(running)
        store.set(pace_key(self.round, self.group_rank), pace.to_json())
        if self.group_rank == 0:
            self._judge(self._fresh(self._read_all(store, pace)))
        if self.arrivals is not None:
            self.arrivals.ask(running, store)

    def close(self) -> None:
        """The attempt ended: stop what runs in the background (the clock responder)."""
        if self.arrivals is not None:
            self.arrivals.close()

    # ------------------------------------------------------------------ steps
    def _due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.every
        return True

    def local_pace(self, running: Collection[int]) -> NodePace:
        """Sample the board; this node's running ranks that have a step time."""
        now = self._clock()
        self.window.add(now, self.board.sample())
        ranks = []
        for slot in range(self.board.nslots):
            rank = self.rank_offset + slot
            measured = self.window.step_time(slot, now)
            if rank in running and measured is not None:
                ranks.append(RankPace(rank, *measured))
        self._seq += 1
        here = sum(1 for slot in range(self.board.nslots) if self.rank_offset + slot in running)
        return NodePace(self.group_rank, self.host, self._seq, tuple(ranks), here)

    def _read_all(self, store: Store, own: NodePace) -> list[NodePace]:
        keys = {g: pace_key(self.round, g) for g in range(self.nnodes) if g != self.group_rank}
        paces = [own]
        for raw in read_present(store, keys).values():
            with contextlib.suppress(ValueError):  # a garbled record counts as no record
                paces.append(NodePace.from_json(raw))
        return paces

    def _fresh(self, paces: Sequence[NodePace]) -> list[NodePace]:
        """The summaries whose node published a new one lately (``_exchange``)."""
        return [p for p in paces if self._freshness.fresh(p.group_rank, p.seq)]

    def _judge(self, paces: Sequence[NodePace]) -> None:
        for change in self.detector.update(paces):
            if change.slow:
                self._say(describe(change, self.detector.threshold))
            self._emit(
                "straggler",
                rank=change.key if change.scope == "rank" else None,
                round=self.round,
                scope=change.scope,
                state="slow" if change.slow else "recovered",
                host=change.host,
                group_rank=change.group_rank,
                ranks=list(change.ranks),
                step_s=float(f"{change.step_s:.4g}"),
                median_s=float(f"{change.median_s:.4g}"),
                threshold=self.detector.threshold,
            )
        self._log_step_times(paces)

    def _log_step_times(self, paces: Sequence[NodePace]) -> None:
        ranks = sorted((r for p in paces for r in p.ranks), key=lambda r: r.rank)
        now = self._clock()
        if not ranks or now < self._next_log:
            return
        self._next_log = now + min(STEP_LOG_EVERY, self.window.window_s)
        self._emit(
            "step_times",
            round=self.round,
            step_s={str(r.rank): float(f"{r.step_s:.4g}") for r in ranks},
            median_s=float(f"{median([r.step_s for r in ranks]):.4g}"),
        )
