"""How far each node's wall clock is from the judging node's, from round trips through the
run store, so that Flight Recorder arrivals of different nodes can be compared.

torch stamps each collective with the issuing node's wall clock, and nothing bounds how
far two nodes' clocks are apart. The judge (:class:`ClockProbe`) measures each node's
offset NTP's way (:func:`offset_from`) through pings that the node's
:class:`ClockResponder` answers, keeping the exchange with the least delay; through a
store on a LAN the error is small against the waits a straggler causes. c10d would log
the responder's expected store failures with a C++ backtrace, so both sides run under
:func:`rallypoint._core.cpp_log.cpp_warnings_off`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from rallypoint._core.cpp_log import cpp_warnings_off
from rallypoint._core.store import Store

__all__ = [
    "PONG_WAIT",
    "SAMPLES",
    "ClockOffset",
    "ClockProbe",
    "ClockResponder",
    "offset_from",
    "ping_key",
]

SAMPLES = 5
"""Exchanges per measurement; the one with the least delay counts."""
PONG_WAIT = timedelta(seconds=1)
"""How long the judge waits for an answer before it skips the node for now."""
RETRY_AFTER = 6
"""Measurements a node that did not answer is skipped for."""
RESPONDER_TIMEOUT = timedelta(hours=24)
"""How long the responder's ``get`` blocks before it asks again."""
STOP = b"stop"


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """A node's clock minus the judge's, and the round trip's delay (the error bound is
    half of it)."""

    offset_ns: int
    delay_ns: int


def offset_from(t1: int, t2: int, t3: int, t4: int) -> ClockOffset:
    """NTP's estimate from one exchange: sent at ``t1`` and answered at ``t4`` (judge's
    clock), received at ``t2`` and answered at ``t3`` (the node's)."""
    return ClockOffset(((t2 - t1) + (t3 - t4)) // 2, (t4 - t1) - (t3 - t2))


def ping_key(round: int, group_rank: int, n: int) -> str:
    """The run-store key of the judge's ``n``-th ping to node ``group_rank``."""
    return f"clock/{round}/{group_rank}/{n}"


def pong_key(round: int, group_rank: int, n: int) -> str:
    return ping_key(round, group_rank, n) + "/pong"


class ClockResponder:
    """A node's answerer of the judge's pings: a daemon thread blocked in ``store.get``
    (a connection of its own: it blocks) until :meth:`close`."""

    def __init__(
        self,
        store: Store,
        *,
        round: int,
        group_rank: int,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._store = store
        store.set_timeout(RESPONDER_TIMEOUT)
        self.round = round
        self.group_rank = group_rank
        self._clock = clock
        self._n = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rallypoint-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with cpp_warnings_off():
            self._answer_pings()

    def _answer_pings(self) -> None:
        while not self._stopped.is_set():
            try:
                ping = self._store.get(ping_key(self.round, self.group_rank, self._n))
            except Exception as exc:
                if _timed_out(exc):
                    continue  # a day without a ping: ask again
                return  # the store went away: nobody pings any more
            t2 = self._clock()
            if ping == STOP or self._stopped.is_set():
                return
            t3 = self._clock()
            with contextlib.suppress(Exception):
                self._store.set(pong_key(self.round, self.group_rank, self._n), f"{t2} {t3}")
            self._n += 1

    def close(self, store: Store) -> None:
        """Stop the thread: ``store`` (another connection) writes ``stop`` where it waits."""
        self._stopped.set()
        if not self._thread.is_alive():
            return  # it ended with its store: the other connection would fail (and log) too
        with contextlib.suppress(Exception), cpp_warnings_off():
            store.set(ping_key(self.round, self.group_rank, self._n), STOP.decode())
        self._thread.join(timeout=1.0)


def _timed_out(exc: Exception) -> bool:
    """torch's store timeout (``DistStoreError``), or a Python store's (``LookupError``)."""
    return isinstance(exc, LookupError) or type(exc).__name__ == "DistStoreError"


class ClockProbe:
    """The judge's side: each node's offset, measured when first needed and then one node
    per :meth:`refresh` (the stalest), since synchronised clocks drift by microseconds a
    minute."""

    def __init__(
        self, *, round: int, samples: int = SAMPLES, clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.round = round
        self.samples = samples
        self._clock = clock
        self._n: dict[int, int] = {}
        self._measured: dict[int, tuple[ClockOffset, int]] = {}  # group rank -> (offset, when)
        self._skip: dict[int, int] = {}  # group rank -> measurements left to skip it for
        self._refreshes = 0

    @property
    def offsets(self) -> dict[int, ClockOffset]:
        return {g: offset for g, (offset, _) in self._measured.items()}

    def refresh(self, store: Store, group_ranks: Iterable[int]) -> dict[int, ClockOffset]:
        """Measure the nodes among ``group_ranks`` not measured yet, else the stalest one;
        return every known offset."""
        self._refreshes += 1
        wanted = sorted(set(group_ranks))
        todo = [g for g in wanted if g not in self._measured]
        if not todo and wanted:
            todo = [min(wanted, key=lambda g: self._measured[g][1])]
        for g in todo:
            if self._skip.get(g, 0) > 0:
                self._skip[g] -= 1
                continue
            offset = self.measure(store, g)
            if offset is None:
                self._skip[g] = RETRY_AFTER
            else:
                self._measured[g] = (offset, self._refreshes)
        return self.offsets

    def measure(self, store: Store, group_rank: int) -> ClockOffset | None:
        """:data:`SAMPLES` exchanges with one node; ``None`` when it does not answer."""
        with cpp_warnings_off():  # a node that does not answer: two lines per timeout
            return self._measure(store, group_rank)

    def _measure(self, store: Store, group_rank: int) -> ClockOffset | None:
        best: ClockOffset | None = None
        for _ in range(self.samples):
            n = self._n.get(group_rank, 0)
            self._n[group_rank] = n + 1
            ping, pong = ping_key(self.round, group_rank, n), pong_key(self.round, group_rank, n)
            t1 = self._clock()
            store.set(ping, "ping")
            try:
                store.wait([pong], PONG_WAIT)
                raw = store.get(pong)
            except Exception:  # a timeout: the node is busy, gone, or not listening yet
                return None
            t4 = self._clock()
            for key in (ping, pong):
                with contextlib.suppress(Exception):
                    store.delete_key(key)
            t2, t3 = (int(t) for t in bytes(raw).split())
            sample = offset_from(t1, t2, t3, t4)
            if best is None or sample.delay_ns < best.delay_ns:
                best = sample
        return best
