"""The elastic coordinator: one node of a multi-node job, round after round.

Every node runs the same command and loops: run the health checks (``_health``), join a
rendezvous round (group rank, node count; group rank 0 starts the workers' store), run
the local workers under an :class:`ElasticPolicy` that follows the round's decisions,
and, on a failure anywhere, let the first node to claim the round spend one restart of
the job's shared budget and decide for everyone. Membership changes restart without
spending budget; an agent that keeps being the root cause is excluded (``_exclusion``).
When every node's workers succeeded the job's status is written and the rendezvous is
closed. The stores and their keys: ``_stores``; the records: ``_records``; the failure
semantics for users: docs/multinode.md.
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from rallypoint._core.blocking import call_in_thread
from rallypoint._core.status import JobStatus
from rallypoint._elastic._burn_in import measure, slow_node
from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._exclusion import leave_excluded, say_host_exclusions
from rallypoint._elastic._health import HealthChecks
from rallypoint._elastic._job import Job, interruptible
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._policy import MEMBERSHIP_CHANGED, ElasticPolicy
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._records import Action, Decision, FailureRecord, NodeRecord
from rallypoint._elastic._round import Round
from rallypoint._elastic._signature import failure_signature
from rallypoint._elastic._stores import RoundStore, prefixed
from rallypoint._elastic._verdict import raise_failure, root_cause
from rallypoint._supervise._errors import (
    LaunchError,
    LaunchInterruptedError,
    LaunchTimeoutError,
)
from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import Failure, GroupInfo, Outcome, OutcomeKind
from rallypoint._supervise._summary import in_process_line, peer_vanished
from rallypoint._watch._observer import Observer
from rallypoint._watch._stacks_exchange import publish_node_count

if TYPE_CHECKING:
    from rallypoint._core.store import Store
    from rallypoint.rendezvous import RendezvousHandler, RendezvousInfo

__all__ = ["EXIT_BARRIER", "POLL_EVERY", "ElasticCoordinator"]

POLL_EVERY = 0.1
"""Least seconds between the store checks of the monitor loop (restart key, waiting nodes,
stack requests: about four round trips); ``--monitor-interval`` raises it, which large jobs
on one TCPStore should do."""
BURN_IN_TIMEOUT = 120.0
"""Seconds the burn-in's transfers may take before it gives up (a dead link)."""
EXIT_BARRIER = 10.0
"""Seconds a node waits for the others to see the job's end before it returns (the node
hosting the rendezvous store must not take it away while others still read it)."""


def _all_replaced(outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """An in-process restart that keeps none of this node's workers, in one line and as
    event fields: ``rank 1 replaced (killed by SIGKILL)``."""
    gone = sorted(outcome.workers, key=lambda w: w.rank)
    line = "; ".join(f"rank {w.rank} replaced ({w.detail})" for w in gone)
    return line or "no worker of this node kept", {"kept": [], "replaced": [w.rank for w in gone]}


def _store_of(info: RendezvousInfo) -> Store:
    """The round's store (torch's class, as the handler API types it) as a ``Store``."""
    from rallypoint._core.torch_c import as_torch_store

    return as_torch_store(info.store)


class ElasticCoordinator:
    """One node of a multi-node job (see the module docstring); owns the node's supervisor."""

    def __init__(
        self,
        supervisor: NodeSupervisor,
        connect: Callable[[], RendezvousHandler],
        observer: Observer,
        *,
        restarts: RestartOptions,
        run_id: str,
        endpoint: str,
        title: str,
        monitor_interval: float,
        timeout: timedelta | None = None,
        share_rpc_secret: bool = True,
        store_timeout: float = 60.0,
        node: str = "",
        min_nodes: int = 1,
        health: HealthChecks | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.connect = connect
        self.observer = observer
        self.restarts = restarts
        self.run_id = run_id
        self.endpoint = endpoint
        self.title = title
        self.timeout = timeout
        self.poll_every = max(POLL_EVERY, monitor_interval)
        self.share_rpc_secret = share_rpc_secret
        """Give every node's workers the run store's RPC secret (False: the user set one)."""
        self.store_timeout = store_timeout
        self.addr = node or supervisor.host
        """Where the other agents reach this node for the burn-in (``--local-addr``, else the
        host name); its name in exclusion records is its rendezvous identity (``Job.node``)."""
        self.min_nodes = min_nodes
        self.health = health
        """Run before each round this node joins (``_health``)."""
        self._local_round = 0
        self._job: Job | None = None
        self._spare: int | None = None
        """The round this node waited out as a spare (said once), until it is admitted."""

    @property
    def job(self) -> Job:
        assert self._job is not None, "run() connects first"
        return self._job

    def run(self) -> list[Any]:
        """Rounds until the job ends; returns this node's results of the last round."""
        self.supervisor.init_warm()
        sup = self.supervisor
        self._job = Job(
            interruptible(self.connect, sup.next_signal, "the rendezvous store"),
            run_id=self.run_id,
            endpoint=self.endpoint,
            observer=self.observer,
            restarts=self.restarts,
            poll_every=self.poll_every,
            next_signal=sup.next_signal,
            signal_pending=sup.signal_pending,
            store_timeout=self.store_timeout,
            min_nodes=self.min_nodes,
        )
        interruptible(self._job.open, sup.next_signal, "the rendezvous store")
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
                f"rendezvous {self.endpoint!r}: {exc}; this node stopped"
            ) from None
        except Exception as exc:  # the store went away between rounds
            raise RendezvousFailedError(
                f"lost the rendezvous store ({type(exc).__name__}: {exc}); this node stopped"
            ) from exc

    def _rounds(self) -> list[Any]:
        from rallypoint.rendezvous import (
            RendezvousClosedError,
            RendezvousError,
            RendezvousGracefulExitError,
        )

        say_host_exclusions(self.job, self.supervisor.host)
        while True:
            if self.health:
                self.health.run(self._local_round)  # an unhealthy node stays out
            try:
                info = self._next_rendezvous()
            except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
                self.job.handler.shutdown()  # stop its heartbeats, as torch's agent does
                self._ended_elsewhere(exc)
                return []
            except RendezvousError as exc:
                raise RendezvousFailedError(f"rendezvous failed: {exc}") from None
            rnd = self._setup_round(info)
            if self.restarts.burn_in and self._burn_in(rnd, _store_of(info)):
                decided = Outcome(OutcomeKind.RESTART, [], reason="burn-in")
                if self.job.blocking(functools.partial(self._after_round, rnd, decided)):
                    return []
                continue
            stragglers = self.observer.straggler_watch(
                round=rnd.number,
                rank_offset=rnd.group.rank_offset,
                group_rank=rnd.group_rank,
                nnodes=rnd.nnodes,
                clock_store=self.job.open_store,
            )
            policy = ElasticPolicy(rnd, host=self.supervisor.host, stragglers=stragglers)
            window = self.job.handler.liveness_window()
            try:
                outcome = self.supervisor.run_attempt(
                    rnd.group,
                    rnd.number,
                    policy,
                    # a membership change restarts without spending budget
                    restart_in_process=True,
                    cause_wait=None if window is None else window.total_seconds(),
                )
            finally:
                if stragglers is not None:
                    stragglers.close()
            if self.job.blocking(functools.partial(self._after_round, rnd, outcome)):
                return self.supervisor.results(outcome)

    # ------------------------------------------------------------------ joining a round
    def _next_rendezvous(self) -> RendezvousInfo:
        """``next_rendezvous()`` in a thread, so that SIGINT/SIGTERM still stop this node
        while it blocks inside the store (a blocked C call does not return for signals);
        a node that waits as a spare says so, once."""

        def poll() -> None:
            self.job.check_signals()
            self._say_spare()

        return call_in_thread(self.job.handler.next_rendezvous, poll=poll, name="rallypoint-store")

    def _say_spare(self) -> None:
        k = self.job.handler.spare_round
        if k is None or self._spare is not None:
            return
        self._spare = k
        write_console(
            2,
            f"rallypoint: this node is a spare: job {self.run_id!r} is full in round {k}; "
            f"it waits to take the place of a lost node at round {k + 1} or later\n".encode(),
        )
        self.observer.emit("spare", round=k, run_id=self.run_id)
        if self.restarts.hot_spare:
            self.supervisor.start_standby(self._standby_group())

    def _standby_group(self) -> GroupInfo:
        """What a hot spare's workers know before they have ranks."""
        return GroupInfo(
            group_rank=0,
            group_world_size=0,
            world_size=0,
            rank_offset=0,
            master_addr="",
            master_port=0,
            run_id=self.run_id,
            max_restarts=self.restarts.max_restarts,
        )

    def _say_admitted(self, k: int, group_rank: int) -> None:
        if self._spare is None:
            return
        self._spare = None
        write_console(
            2,
            f"rallypoint: the spare joins job {self.run_id!r} in round {k} as node "
            f"{group_rank}\n".encode(),
        )

    def _ended_elsewhere(self, exc: Exception) -> None:
        status = ""
        if self.job.has_run_store:
            try:
                status = self.job.blocking(self.job.run.status)
            except LaunchInterruptedError:
                raise
            except Exception:
                status = ""
        if status == JobStatus.SUCCEEDED:
            write_console(2, b"rallypoint: the job already finished successfully\n")
            return
        raise RendezvousFailedError(
            f"{exc} (job status: {status or 'unknown'}); this node did not run"
        )

    def _setup_round(self, info: RendezvousInfo) -> Round:
        """The round's group: its store calls in threads (``Job.blocking``), the warm
        process's (the worker store of group rank 0) on this thread."""
        k = self.job.handler.round
        if k is None:
            k = self._local_round
        self._local_round = k + 1
        job = self.job
        round_store = _store_of(info)
        job.blocking(lambda: job.adopt_round_store(round_store))
        store = RoundStore(prefixed(f"rallypoint/round{k}", round_store))
        group_rank, nnodes = int(info.rank), int(info.world_size)
        self._say_admitted(k, group_rank)
        sup = self.supervisor

        def join_round() -> tuple[int, list[NodeRecord]]:
            # read before this node counts as present: no node starts its workers (and so
            # no failure spends budget) until every node is, so all see the same count
            restart_count = job.run.restarts()
            store.publish_node(group_rank, NodeRecord(sup.nproc, sup.host))
            return restart_count, store.nodes(nnodes)

        restart_count, nodes = job.blocking(join_round)
        if group_rank == 0:
            assert info.bootstrap_store_info is not None
            master = info.bootstrap_store_info.master_addr
            port = sup.start_store(master, 0)
            job.blocking(lambda: store.publish_master(master, port))
        addr, port = job.blocking(store.master)
        secret = job.blocking(job.rpc_secret) if self.share_rpc_secret else ""
        sizes = [n.nproc for n in nodes]
        group = GroupInfo(
            group_rank=group_rank,
            group_world_size=nnodes,
            world_size=sum(sizes),
            rank_offset=sum(sizes[:group_rank]),
            master_addr=addr,
            master_port=port,
            run_id=self.run_id,
            restart_count=restart_count,
            max_restarts=self.restarts.max_restarts,
            rpc_secret=secret,
        )
        job.blocking(lambda: publish_node_count(job.run.store, nnodes))
        members = [n.host for n in nodes]
        self.observer.emit(
            "round",
            round=k,
            world_size=group.world_size,
            nnodes=nnodes,
            run_id=self.run_id,
            group_rank=group_rank,
        )
        self.observer.emit("members", round=k, members=members, group_rank=group_rank)
        return Round(number=k, group=group, members=members, store=store, job=self.job)

    def _burn_in(self, rnd: Round, round_store: Store) -> bool:
        """Time the nodes' links (``_burn_in``); True when a slow node is being excluded
        (the round is decided: every node restarts without it)."""
        store = prefixed(f"rallypoint/round{rnd.number}/burnin", round_store)
        times = self.job.blocking(
            lambda: measure(store, rnd.group_rank, rnd.nnodes, self.addr, BURN_IN_TIMEOUT)
        )
        self.observer.emit(
            "burn_in",
            round=rnd.number,
            forward=times.forward,
            backward=times.backward,
            gemm=times.gemm,
        )
        slow = slow_node(times)
        if slow is None:
            return False
        g, why = slow
        host = rnd.members[g]
        if rnd.nnodes - 1 < self.min_nodes:
            write_console(
                2,
                f"rallypoint: burn-in: node {host} (group rank {g}): {why}; not excluded, "
                f"fewer than {self.min_nodes} node(s) would be left\n".encode(),
            )
            return False
        if g == rnd.group_rank:
            self.job.blocking(lambda: rnd.exclude_now(self.job.node, self.supervisor.host, why))
        return True

    # ------------------------------------------------------------------ after a round
    def _after_round(self, rnd: Round, outcome: Outcome) -> bool:
        """True when the job is over for this node (success); raises on failure."""
        match outcome.kind:
            case OutcomeKind.SIGNAL:
                name = signal.Signals(outcome.signum).name
                raise LaunchInterruptedError(
                    f"received {name}: forwarded it to the workers and stopped",
                    signum=outcome.signum,
                )
            case OutcomeKind.TIMEOUT:
                rnd.claim("the job ran past --timeout", spend=True, force_fail=True)
                raise LaunchTimeoutError(f"the job did not finish within {self.timeout}")
            case OutcomeKind.LOST:
                raise RendezvousFailedError(outcome.reason + "; stopped this node's workers")
            case OutcomeKind.FAILED | OutcomeKind.BAD_TARGET | OutcomeKind.FATAL:
                assert outcome.failure is not None
                self._on_failure(rnd, outcome.failure, outcome.kind)
            case OutcomeKind.OK:
                if self._wait_job_done(rnd):
                    self._finish(rnd, JobStatus.SUCCEEDED)
                    return True
            case OutcomeKind.HANG | OutcomeKind.RESTART:
                pass  # the round is decided already
        decision = rnd.decision()
        if decision.excluded and decision.excluded == self.job.node:
            host = self.supervisor.host
            leave_excluded(self.job, self.observer, rnd.number, decision, host, EXIT_BARRIER)
        if decision.action is Action.RESTART:
            self._announce_restart(rnd, decision, outcome)
            return False
        self._fail(rnd, outcome, decision)

    def _on_failure(self, rnd: Round, failure: Failure, kind: OutcomeKind) -> None:
        w = failure.worker
        rnd.store.publish_failure(
            FailureRecord(
                time=failure.time,
                elapsed=failure.elapsed,
                host=self.supervisor.host,
                group_rank=rnd.group_rank,
                rank=w.rank,
                local_rank=w.local_rank,
                pid=w.pid,
                exitcode=w.exitcode,
                detail=w.detail,
                traceback=failure.traceback,
            )
        )
        if not self._peer_loss(rnd, failure):  # else: a restart is decided; follow it
            fatal = kind is OutcomeKind.FATAL
            rnd.claim(
                f"rank {w.rank} on {self.supervisor.host} {w.detail}",
                spend=True,
                force_fail=kind is OutcomeKind.BAD_TARGET or fatal,
                signature=failure_signature(w.rank, w.detail, failure.traceback),
                note=f"rank {w.rank} raised FatalError; not restarting" if fatal else "",
                node=self.job.node,
                host=self.supervisor.host,
            )

    def _peer_loss(self, rnd: Round, failure: Failure) -> bool:
        """A worker that failed in a collective because a peer vanished is not a job failure
        when that peer's node is gone: wait up to the liveness window for another node's
        decision or a membership change (which restarts without spending budget)."""
        if rnd.store.decided():
            return True
        window = self.job.handler.liveness_window()
        if not peer_vanished(failure.traceback) or window is None:
            return False
        deadline = time.monotonic() + window.total_seconds()
        while time.monotonic() < deadline:
            if rnd.store.decided() or self._membership_changed(rnd, MEMBERSHIP_CHANGED):
                return True
            self.job.check_signals()
            time.sleep(self.poll_every)
        return False

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
        where = "every node"
        if decision.excluded:
            where = f"the other nodes; {decision.note}"
        used = f"restarts used: {decision.count} of {self.restarts.max_restarts}"
        fields: dict[str, Any] = {}
        line = f"restarting the workers on {where} ({used})"
        if outcome.kept:
            kept, fields = in_process_line(outcome)
            line = f"in-process restart on {self.supervisor.host} ({used}): {kept}"
        elif outcome.in_process:  # none kept here; the other nodes keep theirs
            replaced, fields = _all_replaced(outcome)
            line = f"in-process restart on {self.supervisor.host} ({used}): {replaced}"
        if decision.excluded and (outcome.kept or outcome.in_process):
            line += f"; {decision.note}"
        write_console(2, f"rallypoint: {decision.reason}; {line}\n".encode())
        self.observer.emit(
            "restart",
            round=rnd.number + 1,
            restart_count=decision.count,
            reason=decision.reason,
            **fields,
        )

    def _finish(self, rnd: Round, status: JobStatus) -> None:
        """Write the job's status, close the rendezvous, and wait briefly for the others."""
        try:
            self.job.run.set_end(rnd.number, rnd.nnodes)  # first: an excluded store host
            self.job.run.set_status(status)  # serves until it sees both (``_exclusion``)
            self.job.handler.set_closed()
            # stop its heartbeats now, while the store is surely up (torch's agent calls
            # shutdown() at the end too); an in-process launch() leaves no thread behind
            self.job.handler.shutdown()
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
        raise_failure(rnd, outcome, decision, root, title=self.title)
