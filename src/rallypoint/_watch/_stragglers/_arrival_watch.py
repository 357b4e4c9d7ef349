"""One attempt's lock-step straggler detection by Flight Recorder arrivals (``_arrivals``).

:class:`~rallypoint._watch._stragglers._watch.StragglerWatch` drives it from the monitor
tick: :meth:`ArrivalWatch.ask` asks this node's workers for the collectives of the
window, :meth:`ArrivalWatch.read` takes the answers on a later tick and judges them, so
the monitor loop never waits for a worker. One node judges its own ranks. In a multi-node
job only group rank 0 judges, over every node's ranks: the others write their samples to
the run store and answer its clock pings (``_clock_offset``), and the judge puts every
node's arrivals on its own clock, so a rank is reported once for the job and a node whose
ranks all arrive late is seen too. A node whose offset is not known yet is left out of
that period's comparison. Only the collectives of this attempt are judged (``since_ns``):
a worker kept by an in-process restart still holds the previous attempt's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from rallypoint._core.store import Store
from rallypoint._watch._flight._records import RankTrace
from rallypoint._watch._stragglers._arrival_records import (
    NodeArrivals,
    arrivals_key,
    arrivals_record,
    read_arrivals_record,
)
from rallypoint._watch._stragglers._arrivals import (
    MAX_RATIO,
    ArrivalVerdict,
    arrivals_since,
    is_straggler,
    judge_arrivals,
)
from rallypoint._watch._stragglers._clock_offset import ClockProbe, ClockResponder
from rallypoint._watch._stragglers._exchange import Freshness, read_present

__all__ = ["ArrivalWatch", "TraceRequest", "describe_arrival"]


class TraceRequest(Protocol):
    """A request for the workers' Flight Recorder traces (``_flight._recorder.FlightRequest``)."""

    def ready(self) -> bool: ...
    def results(self, timeout: float) -> dict[int, RankTrace]: ...


def describe_arrival(verdict: ArrivalVerdict, host: str, threshold: float) -> str:
    """The screen line for a rank the others wait for at their collectives."""
    pace = f"{verdict.ratio:.1f}x"
    if verdict.ratio >= MAX_RATIO:
        pace = f"over {MAX_RATIO:.0f}x"  # they waited for it (nearly) all the time
    return (
        f"rallypoint: straggler: rank {verdict.rank} on {host} arrives last at "
        f"{verdict.last} of {verdict.collectives} collectives, {verdict.lag_s * 1e3:.3g} ms "
        f"after the others; they wait for it: its pace is {pace} theirs "
        f"(Flight Recorder arrivals; --straggler-threshold {threshold:g})\n"
    )


class ArrivalWatch:
    """See the module docstring. ``ask`` asks this node's workers, given ``{rank: pid}``,
    for their traces; ``clock_store`` opens a store connection of its own for the clock
    responder (nodes other than the judge of a multi-node job); ``since_ns``: when the
    attempt started (``wall_clock``), before which no entry is judged (``None``: all)."""

    def __init__(
        self,
        ask: Callable[[Mapping[int, int]], TraceRequest],
        *,
        threshold: float,
        recover_at: float,
        host: str,
        round: int,
        group_rank: int,
        nnodes: int,
        window_s: float,
        every: float,
        emit: Callable[..., Any],
        say: Callable[[str], None],
        clock: Callable[[], float],
        clock_store: Callable[[], Store] | None = None,
        wall_clock: Callable[[], int] = time.time_ns,
        since_ns: int | None = None,
    ) -> None:
        self._ask = ask
        self.since_ns = since_ns
        self.threshold = threshold
        self.recover_at = recover_at
        self.host = host
        self.round = round
        self.group_rank = group_rank
        self.nnodes = nnodes
        self.window_s = window_s
        self.every = every
        self._emit = emit
        self._say = say
        self._clock = clock
        self._clock_store = clock_store
        self._asked: TraceRequest | None = None  # a request not read yet
        self._next = 0.0
        self._late: int | None = None  # the rank reported as arriving last, until it recovers
        self._seq = 0
        self._freshness = Freshness(every, clock)
        self._hosts: dict[int, tuple[str, int]] = {}  # rank -> (host, group rank)
        self._wall_clock = wall_clock  # what torch stamps arrivals with
        self._probe = ClockProbe(round=round, clock=wall_clock)
        self._responder: ClockResponder | None = None
        self._store: Store | None = None

    @property
    def judges(self) -> bool:
        return self.group_rank == 0

    def ask(self, running: Collection[int], store: Store | None = None) -> None:
        """Ask the workers for their arrivals, if a period has passed; a request not yet
        answered in full is judged on what came."""
        if not isinstance(running, Mapping) or not running:
            return
        if store is not None and not self.judges:
            self._listen(store)
        if self.nnodes == 1 and len(running) < 2:
            return
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.every
        self.read(running, store, force=True)
        self._asked = self._ask(running)

    def read(
        self, running: Collection[int], store: Store | None = None, *, force: bool = False
    ) -> None:
        """Take the answers of the last request once every worker answered (``force``:
        what came); judge them, or send them to the judge."""
        asked = self._asked
        if asked is None or not (force or asked.ready()):
            return
        self._asked = None
        local = {r: t for r, t in asked.results(0.0).items() if r in running}
        if self.since_ns is not None:  # this node's clock, which stamped its workers' entries
            local = arrivals_since(local, self.since_ns)
        if self.nnodes == 1 or store is None or not (self.judges or self._responder):
            self._judge(local, {})  # one node, or no clock to compare with: its ranks alone
            return
        self._seq += 1
        sample = NodeArrivals(self._seq, self.host, local)
        if not self.judges:
            store.set(arrivals_key(self.round, self.group_rank), arrivals_record(sample))
            return
        self._judge_nodes(store, sample)

    def close(self) -> None:
        """Stop the clock responder, if one runs."""
        if self._responder is not None and self._store is not None:
            self._responder.close(self._store)
        self._responder = None

    # ------------------------------------------------------------------ steps
    def _listen(self, store: Store) -> None:
        """Start answering the judge's clock pings (before the first sample is sent, so
        that the judge finds the responder up)."""
        self._store = store
        if self._responder is None and self._clock_store is not None and self.nnodes > 1:
            try:
                connection = self._clock_store()
            except Exception as exc:  # no second connection: this node judges its own ranks
                self._clock_store = None
                self._say(f"rallypoint: straggler arrivals judged on this node only: {exc}\n")
                return
            self._responder = ClockResponder(
                connection, round=self.round, group_rank=self.group_rank, clock=self._wall_clock
            )

    def _judge_nodes(self, store: Store, own: NodeArrivals) -> None:
        """The judge: every fresh node's sample, its clock offset subtracted."""
        samples = {self.group_rank: own}
        keys = {g: arrivals_key(self.round, g) for g in range(self.nnodes) if g != self.group_rank}
        for g, raw in read_present(store, keys).items():
            with contextlib.suppress(ValueError):  # a garbled record counts as no record
                sample = read_arrivals_record(raw)
                if self._freshness.fresh(g, sample.seq):
                    samples[g] = sample
        clocks = self._probe.refresh(store, [g for g in samples if g != self.group_rank])
        traces: dict[int, RankTrace] = {}
        offsets: dict[int, int] = {}
        for g, sample in samples.items():
            if g != self.group_rank and g not in clocks:
                continue  # no offset yet: its arrivals cannot be compared
            for rank, trace in sample.traces.items():
                traces[rank] = trace
                offsets[rank] = clocks[g].offset_ns if g in clocks else 0
                self._hosts[rank] = (sample.host, g)
        self._judge(traces, offsets)

    def _judge(self, traces: Mapping[int, RankTrace], offsets: Mapping[int, int]) -> None:
        subset = self.nnodes > 1  # a node's ranks, or those whose node's clock is known
        verdict = judge_arrivals(traces, window_s=self.window_s, offsets=offsets, subset=subset)
        self._report(verdict)

    def _report(self, verdict: ArrivalVerdict | None) -> None:
        """Report a rank once when the others start waiting for it, once when they stop."""
        if verdict is None:
            return  # too few collectives in the window: no change either way
        if self._late is not None and (
            verdict.rank != self._late or verdict.ratio <= self.recover_at
        ):
            self._emit_change(self._late, verdict, slow=False)
            self._late = None
        if self._late is None and is_straggler(verdict, self.threshold):
            self._late = verdict.rank
            host, _ = self._hosts.get(verdict.rank, (self.host, self.group_rank))
            self._say(describe_arrival(verdict, host, self.threshold))
            self._emit_change(verdict.rank, verdict, slow=True)
        self._emit(
            "arrival_lags",
            round=self.round,
            lag_s={str(r): float(f"{v:.4g}") for r, v in verdict.lags_s.items()},
        )

    def _emit_change(self, rank: int, verdict: ArrivalVerdict, *, slow: bool) -> None:
        host, group_rank = self._hosts.get(rank, (self.host, self.group_rank))
        self._emit(
            "straggler",
            rank=rank,
            round=self.round,
            scope="arrival",
            state="slow" if slow else "recovered",
            host=host,
            group_rank=group_rank,
            ranks=[rank],
            lag_s=float(f"{verdict.lag_s:.4g}"),
            last=verdict.last,
            collectives=verdict.collectives,
            ratio=float(f"{verdict.ratio:.4g}"),
            threshold=self.threshold,
        )
