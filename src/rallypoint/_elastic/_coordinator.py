"""The restart loop: one node of a job, round after round, on one node or many.

Every node runs the same loop: run the health checks (``_health``), join a round (its
:class:`Membership`: the rendezvous of a multi-node job, ``_rendezvous_rounds``, or a
world of its own, ``_one_node``), run the local workers under the membership's policy,
and hand the outcome to the round (``_round``: the one restart policy, from an outcome to
a decision; the first node to claim the round decides for everyone, and a job of one node
claims its own rounds). Membership changes restart without spending budget; an agent
that keeps being the root cause is excluded (``_exclusion``). When every node's workers
succeeded the job's status is written and the rendezvous is closed; a failed job raises
the same error on every node (``_verdict``). The stores and their keys: ``_stores``; the
records: ``_records``; the failure semantics for users: docs/multinode.md.
"""

from __future__ import annotations

import functools
import signal
import time
from datetime import timedelta
from typing import Any, NoReturn, Protocol

from rallypoint._core.status import JobStatus
from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._health._checks import HealthChecks
from rallypoint._elastic._health._exclusion import leave_excluded
from rallypoint._elastic._job import Job
from rallypoint._elastic._monitor_tick import MEMBERSHIP_CHANGED
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._records import Action, Decision, FailureRecord
from rallypoint._elastic._round import Round
from rallypoint._elastic._verdict import raise_failure, root_cause
from rallypoint._supervise._errors import (
    LaunchError,
    LaunchInterruptedError,
    LaunchTimeoutError,
)
from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import Failure, Outcome, OutcomeKind, in_process_line
from rallypoint._supervise._stop import INTERRUPT_GRACE
from rallypoint._supervise._stop_reasons import AttemptPolicy
from rallypoint._watch._observer import Observer
from rallypoint._watch._stragglers._watch import StragglerWatch

__all__ = ["EXIT_BARRIER", "POLL_EVERY", "Coordinator", "Membership"]

POLL_EVERY = 0.1
"""Least seconds between the store checks of the monitor loop (restart key, waiting nodes,
stack requests: about four round trips); ``--monitor-interval`` raises it, which large jobs
on one TCPStore should do."""
EXIT_BARRIER = 10.0
"""Seconds a node waits for the others to see the job's end before it returns (the node
hosting the rendezvous store must not take it away while others still read it)."""


class Membership(Protocol):
    """How this node takes part in the job's rounds: ``_rendezvous_rounds.RendezvousRounds``
    (a multi-node job) or ``_one_node.OneNode``."""

    one_node: bool
    """A job of one node: its own wording, no exclusion, no rendezvous store to lose."""
    run_id: str
    endpoint: str
    min_nodes: int
    store_timeout: float

    def connect(self) -> Any:
        """The node's rendezvous handler (``None``: no rendezvous)."""
        ...

    def open(self, job: Job) -> None:
        """Give the job its run store."""
        ...

    def close(self, job: Job) -> None:
        """The job ended: close what it joined."""
        ...

    def join(self, job: Job, number: int) -> Round | None:
        """The next round (``number`` by this node's count); ``None``: the job ended
        elsewhere, without this node."""
        ...

    def burn_in(self, rnd: Round) -> bool:
        """True when the round was decided before its attempt (a slow node excluded)."""
        ...

    def policy(self, rnd: Round) -> tuple[AttemptPolicy, StragglerWatch | None]:
        """The attempt's policy, and its straggler watch (closed when the attempt ends)."""
        ...

    def restart_in_process(self, rnd: Round) -> bool:
        """Whether the attempt's workers may be kept for an in-process restart."""
        ...

    def cause_wait(self, job: Job) -> float | None:
        """How long a failure that says a peer vanished waits for its cause, all waits
        together (``_supervise._peer_loss``); ``None``: no liveness window to wait (one
        node, or a rendezvous without heartbeats), only for a cause on this node."""
        ...


def _all_replaced(outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """An in-process restart that keeps none of this node's workers, in one line and as
    event fields: ``rank 1 replaced (killed by SIGKILL)``."""
    gone = sorted(outcome.workers, key=lambda w: w.rank)
    line = "; ".join(f"rank {w.rank} replaced ({w.detail})" for w in gone)
    return line or "no worker of this node kept", {"kept": [], "replaced": [w.rank for w in gone]}


def _signal_line(outcome: Outcome) -> str:
    """The node's line when a signal stopped it; a Ctrl-C's says "interrupted" (the
    workers print nothing of it: ``Stop``)."""
    name = signal.Signals(outcome.signum).name
    if outcome.signum == signal.SIGINT:
        killed = [w.rank for w in outcome.workers if w.exitcode == -signal.SIGKILL]
        ranks = ", ".join(map(str, killed))
        some = f"ranks {ranks} were" if len(killed) > 1 else f"rank {ranks} was"
        return "interrupted: received SIGINT and stopped the workers" + (
            f"; {some} killed (SIGKILL): still running after {INTERRUPT_GRACE:g} s or a second "
            "Ctrl-C"
            if killed
            else ""
        )
    states = "; ".join(f"rank {w.rank}: {w.detail}" for w in outcome.workers)
    return f"received {name}: forwarded it to the workers and stopped" + (
        f" ({states})" if states else ""
    )


class Coordinator:
    """One node of a job (see the module docstring); owns the node's supervisor."""

    def __init__(
        self,
        supervisor: NodeSupervisor,
        membership: Membership,
        observer: Observer,
        *,
        restarts: RestartOptions,
        title: str,
        monitor_interval: float = POLL_EVERY,
        timeout: timedelta | None = None,
        health: HealthChecks | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.membership = membership
        self.observer = observer
        self.restarts = restarts
        self.title = title
        self.timeout = timeout
        self.poll_every = max(POLL_EVERY, monitor_interval)
        self.health = health
        """Run before each round this node joins (``_health``)."""
        self._next_round = 0
        self._job: Job | None = None

    @property
    def job(self) -> Job:
        assert self._job is not None, "run() connects first"
        return self._job

    def run(self) -> list[Any]:
        """Rounds until the job ends; returns this node's results of the last round."""
        m, sup = self.membership, self.supervisor
        self._job = Job(
            m.connect(),
            run_id=m.run_id,
            endpoint=m.endpoint,
            observer=self.observer,
            restarts=self.restarts,
            poll_every=self.poll_every,
            next_signal=sup.next_signal,
            signal_pending=sup.signal_pending,
            store_timeout=m.store_timeout,
            min_nodes=m.min_nodes,
        )
        m.open(self._job)
        if m.one_node:  # its store is in memory: nothing to lose
            return self._rounds()
        if self.health:
            job = self._job
            self.health.context.store = lambda: job.run.store if job.has_run_store else None
        from rallypoint.rendezvous import RendezvousStateError

        try:
            return self._rounds()
        except (LaunchError, ValueError, TypeError):
            raise
        except RendezvousStateError as exc:  # a malformed record: every agent runs our code
            raise RendezvousFailedError(
                f"rendezvous {m.endpoint!r}: {exc}; this node stopped"
            ) from None
        except Exception as exc:  # the store went away between rounds
            raise RendezvousFailedError(
                f"lost the rendezvous store ({type(exc).__name__}: {exc}); this node stopped"
            ) from exc

    def _rounds(self) -> list[Any]:
        m = self.membership
        while True:
            if self.health:
                self.health.run(self._next_round)  # an unhealthy node stays out
            rnd = m.join(self.job, self._next_round)
            if rnd is None:
                return []
            self._next_round = rnd.number + 1
            if m.burn_in(rnd):
                if self._after(rnd, Outcome(OutcomeKind.RESTART, [], reason="burn-in")):
                    return []
                continue
            outcome = self._attempt(rnd)
            if self._after(rnd, outcome):
                return self.supervisor.results(outcome)

    def _attempt(self, rnd: Round) -> Outcome:
        m = self.membership
        policy, stragglers = m.policy(rnd)
        try:
            return self.supervisor.run_attempt(
                rnd.group,
                rnd.number,
                policy,
                restart_in_process=m.restart_in_process(rnd),
                cause_wait=m.cause_wait(self.job),
            )
        finally:
            if stragglers is not None:
                stragglers.close()

    def _after(self, rnd: Round, outcome: Outcome) -> bool:
        """True when the job is over for this node (success); raises on failure (the
        workers kept for an in-process restart that will not come are stopped)."""
        after = functools.partial(self._after_round, rnd, outcome)
        try:  # a store in memory never blocks; a rendezvous store may
            return after() if self.membership.one_node else self.job.blocking(after)
        except BaseException:  # Ctrl-C too
            self.supervisor.stop_kept()
            raise

    # ------------------------------------------------------------------ after a round
    def _after_round(self, rnd: Round, outcome: Outcome) -> bool:
        match outcome.kind:
            case OutcomeKind.SIGNAL:
                raise LaunchInterruptedError(_signal_line(outcome), signum=outcome.signum)
            case OutcomeKind.TIMEOUT:
                self._judge(rnd, outcome)
                raise LaunchTimeoutError(
                    f"the job did not finish within {self.timeout}; its workers were killed"
                )
            case OutcomeKind.LOST:
                raise RendezvousFailedError(outcome.reason + "; stopped this node's workers")
            case OutcomeKind.FAILED | OutcomeKind.BAD_TARGET | OutcomeKind.FATAL:
                assert outcome.failure is not None
                self._publish_failure(rnd, outcome.failure)
                if not self._peer_loss(rnd, outcome.failure):  # else a restart is decided
                    self._judge(rnd, outcome)
            case OutcomeKind.OK:
                if self._wait_job_done(rnd):
                    self._finish(rnd, JobStatus.SUCCEEDED)
                    return True
            case OutcomeKind.HANG:
                self._judge(rnd, outcome)
            case OutcomeKind.RESTART:
                pass  # the round is decided already
        decision = rnd.decision()
        if decision.excluded and decision.excluded == self.job.node:
            host = self.supervisor.host
            leave_excluded(self.job, self.observer, rnd.number, decision, host, EXIT_BARRIER)
        if decision.action is Action.RESTART:
            self._announce_restart(rnd, decision, outcome)
            return False
        self._fail(rnd, outcome, decision)

    def _judge(self, rnd: Round, outcome: Outcome) -> None:
        rnd.judge(outcome, host=self.supervisor.host, one_node=self.membership.one_node)

    def _publish_failure(self, rnd: Round, failure: Failure) -> None:
        w = failure.worker
        host = self.supervisor.host
        rnd.store.publish_failure(
            FailureRecord(
                time=failure.time,
                elapsed=failure.elapsed,
                host=host,
                group_rank=rnd.group_rank,
                rank=w.rank,
                local_rank=w.local_rank,
                pid=w.pid,
                exitcode=w.exitcode,
                detail=w.detail,
                traceback=failure.traceback,
            )
        )

    def _peer_loss(self, rnd: Round, failure: Failure) -> bool:
        """A worker that failed in a collective because a peer vanished is not a job failure
        when that peer's node is gone: wait for another node's decision or a membership
        change (which restarts without spending budget) for what is left of the failure's
        wait for a cause (``Failure.peer_loss``: the attempt spent the rest)."""
        if rnd.store.decided():
            return True
        loss = failure.peer_loss
        if loss is None or self.membership.one_node:  # its own, or no other node to lose
            return False
        while True:
            if rnd.store.decided() or self._membership_changed(rnd, MEMBERSHIP_CHANGED):
                return True
            left = loss.left(time.monotonic())
            if left <= 0:
                return False
            self.job.check_signals()
            time.sleep(min(self.poll_every, left))

    def _membership_changed(self, rnd: Round, reason: str) -> bool:
        waiting = self.job.nodes_waiting()
        if waiting > 0:
            rnd.claim(reason.format(waiting=waiting), spend=False)
        return waiting > 0

    def _wait_job_done(self, rnd: Round) -> bool:
        """This node succeeded: wait until every node did (True) or a restart was decided."""
        done = rnd.store.node_done()
        while done < rnd.nnodes:
            if rnd.store.decided():
                return False
            if self._membership_changed(rnd, "membership changed after this node finished"):
                return False
            self.job.answer_stacks({}, rnd.group_rank)
            self.job.check_signals()
            time.sleep(self.poll_every)
            done = rnd.store.done()
        return True

    def _announce_restart(self, rnd: Round, decision: Decision, outcome: Outcome) -> None:
        line, fields = self._restart_line(decision, outcome)
        write_console(2, f"rallypoint: {line}\n".encode())
        self.observer.emit(
            "restart",
            round=rnd.number + 1,
            restart_count=decision.count,
            reason=decision.reason,
            **fields,
        )

    def _restart_line(self, decision: Decision, outcome: Outcome) -> tuple[str, dict[str, Any]]:
        """What every restart says: the cause and what restarts, with the budget used; and
        the kept and replaced ranks as event fields."""
        budget = self.restarts.max_restarts
        fields: dict[str, Any] = {}
        if self.membership.one_node:
            count = f"restart {decision.count} of {budget}"
            if outcome.kept:
                kept, fields = in_process_line(outcome)
                return f"in-process {count}: {kept}", fields
            return f"{decision.reason}; restarting the worker group ({count})", fields
        where = "every node"
        if decision.excluded:
            where = f"the other nodes; {decision.note}"
        used = f"restarts used: {decision.count} of {budget}"
        line = f"restarting the workers on {where} ({used})"
        host = self.supervisor.host
        if outcome.kept:
            kept, fields = in_process_line(outcome)
            line = f"in-process restart on {host} ({used}): {kept}"
        elif outcome.in_process:  # none kept here; the other nodes keep theirs
            replaced, fields = _all_replaced(outcome)
            line = f"in-process restart on {host} ({used}): {replaced}"
        if decision.excluded and (outcome.kept or outcome.in_process):
            line += f"; {decision.note}"
        return f"{decision.reason}; {line}", fields

    def _finish(self, rnd: Round, status: JobStatus) -> None:
        """Write the job's status, close the rendezvous, and wait briefly for the others."""
        try:
            self.job.run.set_end(rnd.number, rnd.nnodes)  # first: an excluded store host
            self.job.run.set_status(status)  # serves until it sees both (``_exclusion``)
            self.membership.close(self.job)
            left = self.job.run.leave(rnd.number)
            deadline = time.monotonic() + EXIT_BARRIER
            while left < rnd.nnodes and time.monotonic() < deadline:
                time.sleep(0.02)
                left = self.job.run.leave(rnd.number, 0)
        except Exception:  # the node hosting the store saw everyone leave and went first
            return

    def _fail(self, rnd: Round, outcome: Outcome, decision: Decision) -> NoReturn:
        root = root_cause(rnd)
        failure = root.failure
        self.observer.emit(
            "failure",
            round=rnd.number,
            rank=None if failure is None else failure.rank,
            exitcode=None if failure is None else failure.exitcode,
            message=decision.reason,
        )
        self._finish(rnd, JobStatus.FAILED)
        if decision.note:
            write_console(2, f"rallypoint: {decision.note}\n".encode())
        raise_failure(
            rnd, outcome, decision, root, title=self.title, one_node=self.membership.one_node
        )
