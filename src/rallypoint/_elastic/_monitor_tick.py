"""The elastic coordinator's policy for one attempt: what every monitor tick checks.

Each tick answers stack requests, follows a decision another node wrote, notes how many
nodes finished (the rest wind down: a hang is then bound by ``--setup-timeout``), restarts
when nodes wait to join or members were lost (without spending budget), and now and then
exchanges step-time summaries for straggler detection. A hang is the whole job's: the
first node to see it gathers every node's stacks, then the round is decided. A store
error is :attr:`OutcomeKind.LOST`.

The store calls never hold the supervisor's loop: they run in a thread
(``rallypoint._core.blocking.InThread``) and :meth:`ElasticPolicy.poll` waits for them at
most :data:`TICK_WAIT` seconds, taking a slow answer on a later tick.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

from rallypoint._core.blocking import InThread, call_in_thread
from rallypoint._elastic._round import Round
from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import Culprit, OutcomeKind, Stop
from rallypoint._supervise._stop_reasons import collective_timeout_reason
from rallypoint._watch._flight._format import hang_report
from rallypoint._watch._idle import Idle
from rallypoint._watch._stacks_exchange import request_stacks
from rallypoint._watch._stragglers._watch import StragglerWatch

__all__ = ["MEMBERSHIP_CHANGED", "ElasticPolicy"]

MEMBERSHIP_CHANGED = "membership changed ({waiting} node(s) waiting to join or lost)"
STACKS_TIMEOUT = 15.0
"""Seconds the node that saw a hang waits for every node's stacks (each node takes up to
``_watch._observer.FLIGHT_TIMEOUT`` for its workers' Flight Recorders)."""
HANG_REPORT_WAIT = 20.0
"""Seconds the other nodes keep answering stack requests after a hang."""
TICK_WAIT = 0.2
"""Most seconds one :meth:`ElasticPolicy.poll` waits for its store checks."""


class _Interrupted(Exception):
    """A signal waits for the supervisor: give up what the policy is doing."""


class ElasticPolicy:
    """The checks of one round's attempt on this node (see the module docstring)."""

    def __init__(self, rnd: Round, *, host: str, stragglers: StragglerWatch | None = None) -> None:
        self.rnd = rnd
        self.job = rnd.job
        self.host = host
        self.stragglers = stragglers
        self._next_poll = 0.0
        self._checks: InThread[Stop | None] | None = None
        self._done = 0  # nodes whose workers all finished, at the last check

    def poll(self, running: Mapping[int, int]) -> Stop | None:
        if self._checks is None:
            now = time.monotonic()
            if now < self._next_poll:
                return None
            self._next_poll = now + self.job.poll_every
            ranks = dict(running)
            self._checks = InThread(lambda: self._check(ranks), name="rallypoint-monitor")
        checks = self._checks
        if not checks.wait(TICK_WAIT):
            limit = self.job.store_timeout
            if checks.age > limit:
                return Stop(
                    OutcomeKind.LOST,
                    f"lost the rendezvous store: no answer within {limit:g} s (read_timeout)",
                )
            return None  # the answer comes on a later tick; the supervisor's loop goes on
        self._checks = None
        try:
            return checks.result()
        except Exception as exc:
            return Stop(OutcomeKind.LOST, f"lost the rendezvous store: {exc}")

    def _check(self, running: Mapping[int, int]) -> Stop | None:
        """One tick's store checks (see the module docstring)."""
        self.job.answer_stacks(running, self.rnd.group_rank)
        if self.stragglers is not None:
            self.stragglers.exchange(self.job.run.store, running)
        if self.rnd.store.decided():
            return Stop(OutcomeKind.RESTART, self.rnd.store.decision().reason)
        if self.rnd.nnodes > 1 and self.job.observer.hang_timeout is not None:
            self._done = self.rnd.store.done()  # only a hang watch reads it
        waiting = self.job.nodes_waiting()
        if waiting > 0:
            reason = MEMBERSHIP_CHANGED.format(waiting=waiting)
            self.rnd.claim(reason, spend=False)
            return Stop(OutcomeKind.RESTART, reason)
        return None

    def nodes_finished(self) -> int:
        return self._done

    def on_hang(self, running: Mapping[int, int], idle: Idle) -> Stop:
        reason = idle.line(f" on {self.host}")
        action = self.job.restarts.on_hang
        self.job.observer.emit(
            "hang", round=self.rnd.number, idle_s=round(idle.seconds, 3), action=action
        )

        found: list[int | None] = [None]

        def report() -> None:
            rank = self._report_once(running, reason).rank
            found[0] = rank if rank is not None else self.job.run.culprit_rank(self.rnd.number)
            self.rnd.claim(reason, spend=True, force_fail=action == "fail")

        try:
            call_in_thread(report, poll=self._stop_if_signalled, name="rallypoint-hang")
        except _Interrupted:
            pass  # the supervisor takes the signal next and stops the workers
        except Exception as exc:
            return Stop(OutcomeKind.LOST, f"lost the rendezvous store: {exc}")
        return Stop(OutcomeKind.HANG, reason, found[0])  # the node that runs it replaces it

    def on_collective_timeout(self, running: Mapping[int, int], rank: int) -> Culprit:
        """As a hang: the first node to see it gathers every node's stacks and traces (the
        ranks that timed out left theirs), the others answer until it has them; it names
        the culprit in the run store for every node's failure summary."""
        self.job.observer.emit("collective_timeout", round=self.rnd.number, rank=rank)
        reason = collective_timeout_reason(rank)
        culprit = Culprit()
        with contextlib.suppress(_Interrupted, Exception):  # the failure is reported anyway
            culprit = call_in_thread(
                lambda: self._report_once(running, reason),
                poll=self._stop_if_signalled,
                name="rallypoint-timeout",
            )
        return culprit

    def _report_once(self, running: Mapping[int, int], reason: str) -> Culprit:
        """One report for the job: the first node to see it gathers every node's stacks and
        prints them (returning the culprit); the others answer until it has."""
        if self.job.run.first_to_see_hang(self.rnd.number):
            return self._report_stacks(running, reason)
        self._answer_until_reported(running)
        return Culprit()

    def _stop_if_signalled(self) -> None:
        if self.job.signal_pending():
            raise _Interrupted

    def _report_stacks(self, running: Mapping[int, int], reason: str) -> Culprit:
        """Ask every node for its stacks (answering our own meanwhile) and print them;
        the culprit (its line is also written to the run store for the other nodes)."""
        result: dict[str, Any] = {}

        def ask() -> None:
            store = self.job.stacks_store
            if store is None:  # no run store: nobody to ask
                return
            with contextlib.suppress(Exception):
                result["r"] = request_stacks(store, timeout=STACKS_TIMEOUT, nnodes=self.rnd.nnodes)

        t = threading.Thread(target=ask, name="rallypoint-stacks", daemon=True)
        t.start()
        while t.is_alive():
            self.job.answer_stacks(running, self.rnd.group_rank)
            t.join(0.05)
        dumps, missing = result.get("r", ({}, {}))
        text, culprit, culprit_rank = hang_report(dumps)
        for node, why in sorted(missing.items()):
            text += f"\nnode {node}: {why}"
        write_console(2, f"rallypoint: {reason}; stacks of every rank:\n{text}\n".encode())
        if culprit:
            self.job.run.publish_culprit(self.rnd.number, culprit, culprit_rank)
        self.job.run.hang_reported(self.rnd.number)
        return Culprit(culprit, culprit_rank)

    def _answer_until_reported(self, running: Mapping[int, int]) -> None:
        """Another node asks for everyone's stacks: keep answering until it has them."""
        deadline = time.monotonic() + HANG_REPORT_WAIT
        while time.monotonic() < deadline:
            self.job.answer_stacks(running, self.rnd.group_rank)
            if self.job.run.hang_is_reported(self.rnd.number):
                break
            time.sleep(0.05)
