"""The single-node coordinator: attempts of one node's workers, restarted within a budget.

Who this node is in the job is static (``LaunchConfig``'s world: ``rank_offset``,
``world_size``, ``master_addr``/``master_port``); the launch with ``rank_offset=0`` hosts
the workers' store in its warm process and empties it before each restart.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from datetime import timedelta
from typing import Any, NoReturn

from rallypoint._elastic._health import HealthChecks
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._protocols import NodeSupervisor
from rallypoint._elastic._signature import Streak, failure_signature, repeated_line
from rallypoint._supervise._errors import (
    BadTargetError,
    HangError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    WorkerFailedError,
)
from rallypoint._supervise._options import WorldOptions
from rallypoint._supervise._output import write_console
from rallypoint._supervise._policy import LocalPolicy
from rallypoint._supervise._state import GroupInfo, Outcome, OutcomeKind
from rallypoint._supervise._summary import format_summary, in_process_line, stopped_with_the_job
from rallypoint._watch._observer import Observer

__all__ = ["LocalCoordinator"]


class LocalCoordinator:
    """Runs one node's job to the end: attempts, restarts, the error of the last attempt."""

    def __init__(
        self,
        supervisor: NodeSupervisor,
        observer: Observer,
        *,
        world: WorldOptions,
        restarts: RestartOptions,
        run_id: str,
        title: str,
        timeout: timedelta | None = None,
        health: HealthChecks | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.observer = observer
        self.world = world
        self.restarts = restarts
        self.run_id = run_id
        self.title = title
        self.timeout = timeout
        self.hosts_store = world.rank_offset == 0
        self.streak = Streak()
        self.health = health
        """Run before the workers start, and before each restart (``_health``)."""

    def run(self) -> list[Any]:
        """Attempts until one succeeds or the budget is spent; the last one's results."""
        if self.health:
            self.health.run(0)
        group = self._group()
        for attempt in range(self.restarts.max_restarts + 1):
            if attempt and self.health:
                self.health.run(attempt)
            if attempt and self.hosts_store:
                self.supervisor.reset_store()
            group = replace(group, restart_count=attempt)
            self.observer.emit(
                "round", round=attempt, world_size=group.world_size, nnodes=1, run_id=self.run_id
            )
            self.observer.emit("members", round=attempt, members=[self.supervisor.host])
            policy = LocalPolicy(
                self.observer,
                attempt=attempt,
                on_hang=self.restarts.on_hang,
                stragglers=self.observer.straggler_watch(
                    round=attempt, rank_offset=group.rank_offset
                ),
            )
            outcome = self.supervisor.run_attempt(
                group, attempt, policy, restart_in_process=attempt < self.restarts.max_restarts
            )
            if outcome.kind is OutcomeKind.OK:
                return self.supervisor.results(outcome)
            try:
                self._after(outcome, attempt)
            except BaseException:  # Ctrl-C too: the kept workers are stopped
                self.supervisor.stop_kept()  # no attempt comes for them
                raise
        raise AssertionError("unreachable: the last attempt raises")

    def _group(self) -> GroupInfo:
        world = self.world
        if self.hosts_store:
            port = self.supervisor.start_store(world.master_addr, world.master_port or 0)
        else:
            self.supervisor.init_warm()
            port = world.master_port or 0
        return GroupInfo(
            group_rank=0,
            group_world_size=1,
            world_size=world.world_size or self.supervisor.nproc,
            rank_offset=world.rank_offset,
            master_addr=world.master_addr,
            master_port=port,
            run_id=self.run_id,
            max_restarts=self.restarts.max_restarts,
        )

    def _after(self, outcome: Outcome, attempt: int) -> None:
        """Announce a restart (returns) or raise the job's error."""
        restarts = self.restarts
        left = attempt < restarts.max_restarts
        match outcome.kind:
            case OutcomeKind.BAD_TARGET:
                assert outcome.failure is not None
                raise BadTargetError(outcome.failure.bad_target)
            case OutcomeKind.SIGNAL:
                name = signal.Signals(outcome.signum).name
                states = "; ".join(f"rank {w.rank}: {w.detail}" for w in outcome.workers)
                raise LaunchInterruptedError(
                    f"received {name}: forwarded it to the workers and stopped ({states})",
                    signum=outcome.signum,
                )
            case OutcomeKind.TIMEOUT:
                raise LaunchTimeoutError(
                    f"the job did not finish within {self.timeout}; its workers were killed"
                )
            case OutcomeKind.HANG if restarts.on_hang == "restart" and left:
                self.streak.reset()
                self._announce_restart(attempt, outcome.reason, outcome)
            case OutcomeKind.HANG:
                self.observer.emit("failure", round=attempt, message=outcome.reason)
                why = "--on-hang fail" if restarts.on_hang == "fail" else "no restarts left"
                raise HangError(f"{outcome.reason}; stopped the workers ({why})")
            case OutcomeKind.FATAL:
                assert outcome.failure is not None
                root = outcome.failure.worker
                write_console(
                    2, f"rallypoint: rank {root.rank} raised FatalError; not restarting\n".encode()
                )
                self._fail(outcome, attempt)
            case _ if left and not self._repeated(outcome):
                assert outcome.failure is not None
                root = outcome.failure.worker
                self._announce_restart(attempt, f"rank {root.rank} {root.detail}", outcome)
            case _:
                self._fail(outcome, attempt)

    def _repeated(self, outcome: Outcome) -> bool:
        """Whether this failure ended ``max_same_failure`` attempts in a row (said once)."""
        failure = outcome.failure
        assert failure is not None
        w = failure.worker
        signature = failure_signature(w.rank, w.detail, failure.traceback)
        count = self.streak.add(signature)
        limit = self.restarts.max_same_failure
        if limit is None or count < limit:
            return False
        write_console(2, f"rallypoint: {repeated_line(signature, count, limit)}\n".encode())
        return True

    def _announce_restart(self, attempt: int, reason: str, outcome: Outcome) -> None:
        count = f"restart {attempt + 1} of {self.restarts.max_restarts}"
        fields: dict[str, Any] = {}
        if outcome.kept:
            line, fields = in_process_line(outcome)
            write_console(2, f"rallypoint: in-process {count}: {line}\n".encode())
        else:
            write_console(
                2, f"rallypoint: {reason}; restarting the worker group ({count})\n".encode()
            )
        self.observer.emit(
            "restart", round=attempt + 1, restart_count=attempt + 1, reason=reason, **fields
        )

    def _fail(self, outcome: Outcome, attempt: int) -> NoReturn:
        failure = outcome.failure
        assert failure is not None
        root = failure.worker
        others = stopped_with_the_job([w for w in outcome.workers if w.pid != root.pid])
        restarts = self.restarts.max_restarts
        attempts = f"attempt {attempt + 1} of {restarts + 1}" if restarts else "no restarts"
        host = self.supervisor.host
        err = WorkerFailedError(
            f"rank {root.rank} (local_rank {root.local_rank}, pid {root.pid}) {root.detail}",
            rank=root.rank,
            local_rank=root.local_rank,
            pid=root.pid,
            host=host,
            exitcode=root.exitcode,
            remote_traceback=failure.traceback,
            summary=format_summary(
                title=self.title,
                root=root,
                host=host,
                when=failure.time,
                elapsed=failure.elapsed,
                traceback_text=failure.traceback,
                others=others,
                attempts=attempts,
                culprit=failure.culprit,
            ),
            others=tuple(others),
            exception=failure.exception,
        )
        if failure.exception is not None:
            err.__cause__ = failure.exception
        self.observer.emit(
            "failure", round=attempt, rank=err.rank, exitcode=err.exitcode, message=str(err)
        )
        raise err
