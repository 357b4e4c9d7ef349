"""One attempt's monitor loop: exits, signals, the deadline, and the policy's say.

The warm process reports every exit the moment it happens (``_warm._exits``), output and
result pipes are read as they fill, and signals to the launcher wake the loop through a
pipe. The first failure stops every worker's whole process tree (SIGTERM, then SIGKILL
after the grace period). A signal to the launcher is forwarded to the workers, which get
``--shutdown-timeout`` seconds; the same signal again or another one kills them at once.
A rank that failed only because a peer vanished under it waits for the failure that
caused it, which is then the root cause (``_peer_loss``: how long, on one clock with the
raised peer losses and the coordinator's wait). Workers of a
``@rallypoint.restartable`` function are interrupted and kept for the next attempt instead
(``_inprocess._agent_side``: the in-process restart's state and timers).
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import time
from dataclasses import dataclass
from typing import Any

from rallypoint._supervise._inprocess._agent_side import InProcess
from rallypoint._supervise._output import OutputRouter, write_console
from rallypoint._supervise._peer_loss import CauseWait, peer_vanished
from rallypoint._supervise._results import ResultPipes
from rallypoint._supervise._signals import SignalQueue
from rallypoint._supervise._state import Failure, Outcome, OutcomeKind, Stop, Worker
from rallypoint._supervise._stop import Stopper
from rallypoint._supervise._stop_reasons import AttemptPolicy
from rallypoint._supervise._summary import bad_target_message, error_info, fatal_message
from rallypoint._supervise._warm._exits import ExitReports
from rallypoint._supervise._worker import BAD_TARGET_EXIT, FATAL_EXIT
from rallypoint._watch._flight._final import COLLECTIVE_TIMEOUT
from rallypoint._watch._observer import Observer
from rallypoint._watch._stacks_format import format_grouped_stacks

__all__ = ["Attempt", "AttemptTools"]

_DRAIN = 0.5
"""Seconds to keep reading pipes after the last worker exited (its children may hold them)."""


@dataclass(frozen=True, slots=True)
class AttemptTools:
    """What every attempt of one supervisor uses."""

    exits: ExitReports
    stopper: Stopper
    signals: SignalQueue
    observer: Observer
    interval: float
    """Seconds between two asks of the policy (``--monitor-interval``)."""
    deadline: float | None
    """When the job's ``timeout`` runs out (``time.monotonic()``), if it has one."""
    started: float
    """When the supervisor started: a failure's elapsed time counts from it."""


class Attempt:
    """Watches ``workers`` (already started) until they are all gone; :meth:`run` says how.
    ``inproc`` runs their in-process restart, ``number`` is the attempt's (its events');
    ``causes`` is the clock of its peer losses' wait for a cause, which ``inproc`` shares."""

    def __init__(
        self,
        tools: AttemptTools,
        *,
        workers: list[Worker],
        router: OutputRouter,
        policy: AttemptPolicy,
        inproc: InProcess,
        causes: CauseWait,
        number: int,
    ) -> None:
        self.tools, self.stopper, self.observer = tools, tools.stopper, tools.observer
        self.workers, self.router, self.policy = workers, router, policy
        self.inproc, self.causes, self.number = inproc, causes, number
        self.by_pid = {w.pid: w for w in workers}
        self.sel = selectors.DefaultSelector()
        self.results = ResultPipes(workers, self.sel)
        # how it ended
        self.kind: OutcomeKind | None = None
        self.reason = ""
        self.root: Worker | None = None
        self.culprit = ""  # the rank the root waited for (a collective timeout's report)
        self.signum = 0
        self.forced = False  # a second signal killed the workers
        # its waits
        self.consequence: Worker | None = None  # a peer-loss failure waiting for its cause
        self.cause_until: float | None = None
        self.stopping: list[Worker] = []
        """The workers being stopped (all of them, but in an in-process restart)."""
        self.kill_at: float | None = None
        self.drain_until: float | None = None
        self.next_poll = time.monotonic() + tools.interval
        self.released = False

    def run(self) -> Outcome:
        self._register()
        self.tools.exits.watch(self.by_pid)
        try:
            self.inproc.check_restartable()  # kept workers said so in an earlier attempt
            while True:
                now = time.monotonic()
                self._reap(now)
                self._take_signals()
                self._check_deadline(now)
                self._poll(now)
                self._escalate(now)
                if self._drained(now):
                    break
                self._wait(now)
        finally:
            self._close()
        return self._outcome()

    # ------------------------------------------------------------------ steps of a tick
    def _register(self) -> None:
        self.sel.register(self.tools.exits.fileno(), selectors.EVENT_READ, "warm")
        if self.tools.signals.wake_fd is not None:
            self.sel.register(self.tools.signals.wake_fd, selectors.EVENT_READ, "signal")
        for fd in self.router.fds():
            self.sel.register(fd, selectors.EVENT_READ, "out")
        for fd in self.inproc.by_fd:
            self.sel.register(fd, selectors.EVENT_READ, "ctl")

    def _reap(self, now: float) -> None:
        exits = self.tools.exits
        exits.read(socket=False)  # set aside while the warm process answered a request
        batch = []
        for exited in exits.take():
            w = self.by_pid[exited.pid]
            if w.status is not None:
                continue
            w.status, w.exited_at = exited.status, now
            self._on_exit(w)
            batch.append(w)
        for w in batch:
            if w.returncode == 0 or self.kind is not None:
                continue
            if w.pid not in self.inproc.told_to_fail and self._peer_loss(w):  # wait for its cause
                if self.consequence is None:
                    self.consequence, self.cause_until = w, self.causes.exit_until(now)
                continue
            self._fail(w, self._failure_kind(w))
        if self.kind is None and self.consequence is not None:
            assert self.cause_until is not None
            late = now >= self.cause_until and not self.inproc.cause_coming(now)
            if late or all(w.status is not None for w in self.workers):
                self._fail(self.consequence, OutcomeKind.FAILED)
        if self.kind is None:
            self.inproc.judge_waiting(now)

    @staticmethod
    def _failure_kind(w: Worker) -> OutcomeKind:
        if w.returncode == BAD_TARGET_EXIT and bad_target_message(w.error_file):
            return OutcomeKind.BAD_TARGET
        if w.returncode == FATAL_EXIT and fatal_message(w.error_file):
            return OutcomeKind.FATAL
        return OutcomeKind.FAILED

    def _fail(self, root: Worker, kind: OutcomeKind) -> None:
        self._end(kind)
        self.root = root
        self.cause_until = None
        if kind is OutcomeKind.FAILED and self._collective_timed_out(root):
            # the rank that never issued the collective still runs: report before the stop
            running = {w.rank: w.pid for w in self.workers if w.status is None}
            self.culprit = self.policy.on_collective_timeout(running, root.rank).line
        self._stop_or_restart(kind, f"rank {root.rank} {root.state().detail}")

    def _timed_out_in_process(self, w: Worker) -> bool:
        """``w``'s function raised because a collective timed out: the rank it waited for
        is killed alone, as a hang's culprit, and the others (``w`` too) restart in process.
        False when that rank is not one of this node's (its own node handles it)."""
        running = {x.rank: x.pid for x in self.workers if x.status is None}
        culprit = self.policy.on_collective_timeout(running, w.rank)
        target = next((x for x in self.workers if x.rank == culprit.rank), None)
        if target is None or target is w or target.status is not None:
            return False
        self._end(OutcomeKind.FAILED)
        self.root, self.culprit = target, culprit.line
        self._stop_some([target], signal.SIGKILL)
        self._stop_or_restart(OutcomeKind.FAILED, f"rank {w.rank}: a collective timed out")
        return True

    def _collective_timed_out(self, w: Worker) -> bool:
        """Its error says so (gloo), or it left a trace (NCCL's watchdog aborts the process
        without a Python error, after writing the trace)."""
        traceback_text, _ = error_info(bytes(w.result), w.error_file)
        if COLLECTIVE_TIMEOUT.search(traceback_text) is not None:
            return True
        return self.observer.left_trace(w.rank, w.pid)

    def _peer_loss(self, w: Worker) -> bool:
        """Whether the failed worker ``w`` says a peer vanished under it: in its error file,
        or in the error a ``launch()`` worker left in its result pipe (read now)."""
        self.results.read_all(w)
        traceback_text, _ = error_info(bytes(w.result), w.error_file)
        return peer_vanished(traceback_text)

    def _take_signals(self) -> None:
        """A signal stops every worker (once, then SIGKILL at once for a second one) and
        says so. A Ctrl-C (SIGINT) is said once the job has stopped (within 5 s) in one
        line; the workers are told first, so that one blocked in a collective or a store
        wait leaves too (``Stop``)."""
        while (signum := self.tools.signals.pop()) is not None:
            name = signal.Signals(signum).name
            quiet = signum == signal.SIGINT
            if self.kind is not OutcomeKind.SIGNAL:
                self.kind, self.signum, self.root = OutcomeKind.SIGNAL, signum, None
                self.inproc.abandon()  # every worker goes
                if quiet:
                    self.inproc.stop_all()
                self._stop(signum)
                say = (
                    f"received {name}: stopping the workers (SIGKILL in "
                    f"{self.stopper.grace:g} s, --shutdown-timeout; send it again to kill "
                    "them now)"
                )
            elif not self.forced:
                self.forced = True
                self.stopper.kill_trees(self.workers, signal.SIGKILL)
                self.kill_at = time.monotonic() + 1.0
                say = f"received {name} while stopping: killed the workers (SIGKILL) at once"
            else:
                continue
            if not quiet and any(w.status is None for w in self.workers):
                write_console(2, f"rallypoint: {say}\n".encode())

    def _check_deadline(self, now: float) -> None:
        deadline = self.tools.deadline
        if self.kind is None and deadline is not None and now >= deadline:
            self._end(OutcomeKind.TIMEOUT)
            self.inproc.abandon()
            self._stop(signal.SIGKILL)

    def _poll(self, now: float) -> None:
        if self.kind is not None or now < self.next_poll:
            return
        self.next_poll = now + self.tools.interval
        running = {w.rank: w.pid for w in self.workers if w.status is None}
        stop: Stop | None = self.policy.poll(running)
        if stop is None:
            live = {w.local_rank: w.rank for w in self.workers if w.status is None}
            finished = sorted(w.rank for w in self.workers if w.status == 0 or w.returned)
            idle = self.observer.idle(live, finished, self.policy.nodes_finished())
            if self.observer.hung(idle):
                stop = self.policy.on_hang(running, idle)
        if stop is None:
            return
        self._end(stop.kind, stop.reason)
        culprit = next((w for w in self.workers if w.rank == stop.culprit), None)
        restartable = stop.kind in (OutcomeKind.HANG, OutcomeKind.RESTART)
        if restartable and self.inproc.can_restart():
            if culprit is not None and culprit.status is None:  # replaced alone
                self._stop_some([culprit], signal.SIGKILL)
            self._stop_or_restart(stop.kind, stop.reason)
            return
        quick = stop.kind in (OutcomeKind.HANG, OutcomeKind.RESTART)
        self._stop(signal.SIGTERM, quick=quick)

    def _escalate(self, now: float) -> None:
        if self.kill_at is not None and now >= self.kill_at:
            self._kill(self.stopping)
            self.kill_at = now + 1.0
        overdue = self.inproc.escalate(now)
        if overdue:
            self._say_where(overdue)
            self._stop_some(overdue, signal.SIGKILL)

    def _say_where(self, overdue: list[Worker]) -> None:
        """Where the ranks that did not leave their function were: a rank the interruption
        could not free is a bug to report, or a call of the user's that ignores it."""
        dumps = self.observer.stacks({w.rank: w.pid for w in overdue})
        if dumps:
            write_console(
                2, f"rallypoint: where they were:\n{format_grouped_stacks(dumps)}\n".encode()
            )

    def _drained(self, now: float) -> bool:
        if any(not w.gone_or_parked for w in self.workers):
            return False
        if self.drain_until is None:
            self._release_kept()
            self._kill(self.workers)  # no orphans, even on success
            self.drain_until = now + _DRAIN
        return (not self.router.fds() and not self.results.open()) or now >= self.drain_until

    def _wait(self, now: float) -> None:
        timeout = self.tools.interval
        deadline = self.tools.deadline if self.kind is None else None
        waits = (self.kill_at, self.cause_until, self.drain_until, *self.inproc.wake_at())
        for t in (*waits, deadline):
            if t is not None:
                timeout = min(timeout, max(0.0, t - now))
        for key, _ in self.sel.select(timeout):
            fd = key.fd
            match key.data:
                case "warm":
                    self.tools.exits.read()
                case "out":
                    if not self.router.on_readable(fd):
                        self.sel.unregister(fd)
                case "res":
                    self.results.on_readable(fd)
                case "ctl":
                    if not self.inproc.on_readable(fd, now, self._on_raised):
                        self.sel.unregister(fd)
                    if self.kind is None:
                        self.inproc.check_restartable()
                case "signal":
                    self.tools.signals.drain_wake_fd()

    # ------------------------------------------------------------------ helpers
    def _end(self, kind: OutcomeKind, reason: str = "") -> None:
        self.kind, self.reason = kind, reason

    def _stop(self, signum: int, *, quick: bool = False) -> None:
        self.stopping = list(self.workers)
        self.kill_at = self.stopper.stop(self.workers, signum, quick=quick)

    def _stop_some(self, targets: list[Worker], signum: int) -> None:
        """Stop ``targets`` only (an in-process restart keeps the others)."""
        self.stopping.extend(w for w in targets if w not in self.stopping)
        spare = [w for w in self.workers if w not in self.stopping]
        self.kill_at = self.stopper.stop(targets, signum, spare=spare)

    def _kill(self, targets: list[Worker]) -> None:
        """SIGKILL ``targets``' trees, sparing every worker that is not among them."""
        spare = [w for w in self.workers if w not in targets or w.parked]
        self.stopper.kill_trees(targets, signal.SIGKILL, spare=spare)

    def _stop_or_restart(self, kind: OutcomeKind, reason: str) -> None:
        """After a failure: interrupt the restartable workers (kept for an in-process
        restart) and stop the others; or, when this attempt cannot restart in process,
        stop them all."""
        restartable = (OutcomeKind.FAILED, OutcomeKind.HANG, OutcomeKind.RESTART)
        if kind in restartable and self.inproc.can_restart():
            others = self.inproc.interrupt(reason, time.monotonic())
            if others:
                self._stop_some(others, signal.SIGTERM)
            return
        self.inproc.refuse()
        self._stop(signal.SIGTERM)

    def _on_raised(self, w: Worker) -> None:
        """``w``'s function raised: a consequence of a failure (keep it) or its own."""
        if self.kind is not None:
            self.inproc.answer_late(w)
        elif (
            self.inproc.can_restart()
            and COLLECTIVE_TIMEOUT.search(w.raised)
            and self._timed_out_in_process(w)
        ):
            pass  # its culprit is replaced; it restarts in process
        else:
            self.inproc.hold_or_fail(w)

    def _release_kept(self) -> None:
        """The kept workers' pipes and channel stay open for the next attempt."""
        if self.released:
            return
        self.released = True
        routed = set(self.router.fds())
        for w in self.inproc.kept():
            for fd in w.pipes:
                if fd in routed:
                    self.sel.unregister(fd)
                    self.router.release(fd)
            out, err = w.pipes  # a stream the worker closed is gone for good
            w.pipes = (out if out in routed else -1, err if err in routed else -1)
            self.results.release(w)
            if w.control is not None and self.inproc.watches(w):
                self.sel.unregister(w.control.fileno())

    def _on_exit(self, w: Worker) -> None:
        self.observer.forget(w.pid, w.rank)
        state = w.state()
        fields: dict[str, Any] = {}
        if state.exitcode is not None and state.exitcode < 0:
            with contextlib.suppress(ValueError):
                fields["signal"] = signal.Signals(-state.exitcode).name
        self.observer.emit(
            "worker_exit",
            round=self.number,
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            state=state.state,
            exitcode=state.exitcode,
            **fields,
        )

    def _close(self) -> None:
        self._release_kept()
        self.router.close()
        self.results.close()
        self.inproc.close()
        self.sel.close()
        self.tools.exits.unwatch()

    def _outcome(self) -> Outcome:
        kind = self.kind or OutcomeKind.OK
        return Outcome(
            kind,
            [w.state() for w in self.workers],
            failure=None if self.root is None else self._failure(self.root, kind),
            signum=self.signum,
            reason=self.reason,
            results=[bytes(w.result) for w in self.workers],
            kept=self.inproc.kept(),
        )

    def _failure(self, root: Worker, kind: OutcomeKind) -> Failure:
        tb, exc = error_info(bytes(root.result), root.error_file)
        bad = bad_target_message(root.error_file) if kind is OutcomeKind.BAD_TARGET else ""
        return Failure(
            worker=root.state(),
            traceback=tb,
            exception=exc,
            time=time.time() - (time.monotonic() - root.exited_at),
            elapsed=root.exited_at - self.tools.started,
            bad_target=bad,
            culprit=self.culprit,
            peer_loss=self.causes.failure(tb, root.exited_at),
        )
