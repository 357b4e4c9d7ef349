"""One attempt's monitor loop: exits, output, results, signals, the deadline and the policy.

The warm process reports every exit the moment it happens, output and result pipes are
read as they fill, and signals to the launcher wake the loop through a pipe. The first
failure stops every worker's whole process tree (SIGTERM, then SIGKILL after the grace
period). A signal to the launcher is forwarded to the workers, which get
``--shutdown-timeout`` seconds; the same signal again or another one kills them at once.
A rank that failed only because a peer vanished under it waits up to :data:`CAUSE_WAIT`
for the failure that caused it, which is then the root cause. With ``restart_grace``,
workers of a ``@rallypoint.restartable`` function are interrupted and kept for the next
attempt instead of being signalled (``_inprocess``).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from rallypoint._supervise._inprocess._agent import InProcess, main_thread_running
from rallypoint._supervise._output import OutputRouter, write_console
from rallypoint._supervise._policy import AttemptPolicy
from rallypoint._supervise._signals import SignalQueue
from rallypoint._supervise._state import Failure, Outcome, OutcomeKind, Stop, Worker
from rallypoint._supervise._stop import Stopper
from rallypoint._supervise._summary import (
    bad_target_message,
    error_info,
    fatal_message,
    peer_vanished,
)
from rallypoint._supervise._warm._messages import Exited
from rallypoint._supervise._warm._process import WarmProcess
from rallypoint._supervise._worker import BAD_TARGET_EXIT, FATAL_EXIT
from rallypoint._watch._flight._final import COLLECTIVE_TIMEOUT
from rallypoint._watch._observer import Observer

__all__ = ["Attempt"]

_DRAIN = 0.5
"""Seconds to keep reading pipes after the last worker exited (its children may hold them)."""
CAUSE_WAIT = 0.5
"""Seconds a failure caused by a vanished peer waits for the peer's own failure."""
SECOND_GRACE = 1.0
"""Seconds the ranks that sleep past ``--restart-grace`` get once the running ones are
killed (they may have been blocked in a collective with them)."""
EXIT_EVENT_WAIT = 10.0
"""Seconds a failure waits for the exit of a worker whose control channel closed (dead,
its exit not yet read), before it is judged the failure's own."""
STORE_RESET_AFTER = 1.0
"""Seconds after an in-process restart's interruption that the store hosted here is emptied,
for a worker still waiting in it (each interrupted worker cuts its own store connections at
once; resetting at once would break them before some have quieted torch's C++ warnings)."""


class Attempt:
    """Watches ``workers`` (already started) until they are all gone; :meth:`run` says how."""

    def __init__(
        self,
        *,
        warm: WarmProcess,
        workers: list[Worker],
        router: OutputRouter,
        stopper: Stopper,
        signals: SignalQueue,
        observer: Observer,
        policy: AttemptPolicy,
        number: int,
        interval: float,
        deadline: float | None,
        started: float,
        restart_grace: float | None = None,
        reset_store: Callable[[], object] | None = None,
        cause_wait: float = CAUSE_WAIT,
        on_restartable: Callable[[], object] | None = None,
    ) -> None:
        self.warm, self.workers, self.router = warm, workers, router
        self.stopper, self.signals, self.observer, self.policy = stopper, signals, observer, policy
        self.number, self.interval, self.deadline, self.started = (
            number,
            interval,
            deadline,
            started,
        )
        self.by_pid = {w.pid: w for w in workers}
        self.by_res = {w.res_fd: w for w in workers if w.res_fd >= 0}
        self.kind: OutcomeKind | None = None
        self.root: Worker | None = None
        self.culprit = ""  # the rank the root waited for (a collective timeout's report)
        self.consequence: Worker | None = None  # a peer-loss failure waiting for its cause
        self.cause_until: float | None = None
        self.signum = 0
        self.forced = False  # a second signal killed the workers
        self.reason = ""
        self.kill_at: float | None = None
        self.drain_until: float | None = None
        self.next_poll = time.monotonic() + interval
        self.pending: list[Exited] = warm.read_events() if warm.events else []
        self.sel = selectors.DefaultSelector()
        self.inproc = InProcess(workers, restart_grace)
        self.reset_store = reset_store
        """Empty the workers' store (hosted here): a survivor blocked on it gets an error."""
        self.vanished: dict[int, float] = {}
        """Workers whose control channel closed before their exit was read: when."""
        self.store_reset_at: float | None = None
        """When an in-process restart empties the store, if the attempt lasts that long."""
        self.cause_wait = cause_wait
        """How long a function's peer-loss exception waits for its cause: on one node, an
        exit; across nodes, the policy's restart (another node's failure)."""
        self.stopping: list[Worker] = []
        """The workers being stopped (all of them, but in an in-process restart)."""
        self.told_to_fail: set[int] = set()
        """Workers whose raised exception was judged their own (no cause to wait for)."""
        self.raised_until: float | None = None
        """Until when the peer-loss exceptions of ``inproc.waiting`` wait for their cause."""
        self.released = False
        self.on_restartable = on_restartable if restart_grace is not None else None
        """Called once, when a worker first says it runs a restartable function."""
        self.others: list[Exited] = []
        """Exits of the warm process's other children (spare workers) seen meanwhile."""

    def run(self) -> Outcome:
        self._register()
        self._check_restartable()  # kept workers said so in an earlier attempt
        try:
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
        self.sel.register(self.warm.fileno(), selectors.EVENT_READ, "warm")
        if self.signals.wake_fd is not None:
            self.sel.register(self.signals.wake_fd, selectors.EVENT_READ, "signal")
        for fd in self.router.fds():
            self.sel.register(fd, selectors.EVENT_READ, "out")
        for fd in self.by_res:
            self.sel.register(fd, selectors.EVENT_READ, "res")
        for fd in self.inproc.by_fd:
            self.sel.register(fd, selectors.EVENT_READ, "ctl")

    def _reap(self, now: float) -> None:
        batch = []
        for exited in self.pending:
            w = self.by_pid.get(exited.pid)
            if w is None:
                self.others.append(exited)
            if w is None or w.status is not None:
                continue
            w.status, w.exited_at = exited.status, now
            self._on_exit(w)
            batch.append(w)
        self.pending = []
        for w in batch:
            if w.returncode == 0 or self.kind is not None:
                continue
            if w.pid not in self.told_to_fail and self._peer_loss(w):  # wait for its cause
                if self.consequence is None:
                    self.consequence, self.cause_until = w, now + CAUSE_WAIT
                continue
            self._fail(w, self._failure_kind(w))
        if self.kind is None and self.consequence is not None:
            assert self.cause_until is not None
            late = now >= self.cause_until and not self._cause_coming(now)
            if late or all(w.status is not None for w in self.workers):
                self._fail(self.consequence, OutcomeKind.FAILED)
        if self.kind is None and self.inproc.waiting:
            assert self.raised_until is not None
            if now >= self.raised_until and not self._cause_coming(now):
                self._own_failure(self.inproc.waiting.pop(0))  # its failure is its own

    def _cause_coming(self, now: float) -> bool:
        """Whether a worker's control channel closed (it died) and its exit has not been
        read yet: the exit, a failure's likely cause, comes from the warm process, which may
        be busy for a while (importing ``torch._dynamo`` once the first workers run)."""
        return any(
            self.by_pid[pid].status is None and now < closed + EXIT_EVENT_WAIT
            for pid, closed in self.vanished.items()
        )

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
        while w.res_fd in self.by_res and self._read_result(w, until_empty=True):
            pass
        traceback_text, _ = error_info(bytes(w.result), w.error_file)
        return peer_vanished(traceback_text)

    def _take_signals(self) -> None:
        while (signum := self.signals.pop()) is not None:
            name = signal.Signals(signum).name
            if self.kind is not OutcomeKind.SIGNAL:
                self.kind, self.signum, self.root = OutcomeKind.SIGNAL, signum, None
                self.inproc.restarting, self.raised_until = None, None  # every worker goes
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
            if any(w.status is None for w in self.workers):
                write_console(2, f"rallypoint: {say}\n".encode())

    def _check_deadline(self, now: float) -> None:
        if self.kind is None and self.deadline is not None and now >= self.deadline:
            self._end(OutcomeKind.TIMEOUT)
            self.inproc.restarting, self.raised_until = None, None
            self._stop(signal.SIGKILL)

    def _poll(self, now: float) -> None:
        if self.kind is not None or now < self.next_poll:
            return
        self.next_poll = now + self.interval
        running = {w.rank: w.pid for w in self.workers if w.status is None}
        stop: Stop | None = self.policy.poll(running)
        if stop is None and self.observer.hung():
            stop = self.policy.on_hang(running, self.observer.idle_seconds())
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
        if self.store_reset_at is not None and now >= self.store_reset_at:
            self._reset_store()
        overdue = self.inproc.overdue(now)
        if not overdue:
            return
        # a rank that runs (spins, holds the GIL in C code) goes first; one that sleeps is
        # likely blocked in a gloo collective with it, which fails once it is gone
        running = [w for w in overdue if main_thread_running(w.pid)]
        if running and len(running) < len(overdue):
            overdue = running
            assert self.inproc.restarting is not None
            self.inproc.restarting.until = now + SECOND_GRACE
        ranks = ", ".join(str(w.rank) for w in overdue)
        write_console(
            2,
            f"rallypoint: in-process restart: rank(s) {ranks} did not leave the function "
            f"within --restart-grace {self.inproc.grace:g} s: replaced\n".encode(),
        )
        self._stop_some(overdue, signal.SIGKILL)

    def _reset_store(self) -> None:
        """Empty the workers' store: a worker that still waits in it gets an error (each
        interrupted worker cuts its own store connections at once; this is the fallback)."""
        self.store_reset_at = None
        if self.reset_store is None:
            return
        with contextlib.suppress(Exception):
            self.reset_store()
        self.pending.extend(self.warm.read_events())  # exits it read meanwhile

    def _drained(self, now: float) -> bool:
        if any(not w.gone_or_parked for w in self.workers):
            return False
        if self.drain_until is None:
            self._release_kept()
            self._kill(self.workers)  # no orphans, even on success
            self.drain_until = now + _DRAIN
        return (not self.router.fds() and not self.by_res) or now >= self.drain_until

    def _wait(self, now: float) -> None:
        timeout = self.interval
        waits = (
            self.kill_at,
            self.cause_until,
            self.raised_until,
            self.drain_until,
            self.store_reset_at,
        )
        for t in (*waits, self.deadline if self.kind is None else None):
            if t is not None:
                timeout = min(timeout, max(0.0, t - now))
        for key, _ in self.sel.select(timeout):
            fd = key.fd
            match key.data:
                case "warm":
                    self.pending.extend(self.warm.read_events())
                case "out":
                    if not self.router.on_readable(fd):
                        self.sel.unregister(fd)
                case "res":
                    self._read_result(self.by_res[fd])
                case "ctl":
                    w = self.inproc.by_fd[fd]
                    if not self.inproc.on_readable(fd, self._on_raised):
                        self.sel.unregister(fd)
                        if w.status is None:
                            self.vanished[w.pid] = now
                    self._check_restartable()
                case "signal":
                    self.signals.drain_wake_fd()

    # ------------------------------------------------------------------ helpers
    def _check_restartable(self) -> None:
        """Call ``on_restartable`` once a worker of this running attempt said it runs a
        restartable function."""
        callback = self.on_restartable
        if callback is None or self.kind is not None:
            return
        if any(w.restartable for w in self.workers):
            self.on_restartable = None
            callback()
            self.pending.extend(self.warm.read_events())  # exits read during its requests

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
        self.raised_until = None  # whoever waited gets its verdict now
        restartable = (OutcomeKind.FAILED, OutcomeKind.HANG, OutcomeKind.RESTART)
        if kind in restartable and self.inproc.can_restart():
            now = time.monotonic()
            others = self.inproc.interrupt(reason, now)
            if others:
                self._stop_some(others, signal.SIGTERM)
            if self.reset_store is not None:
                self.store_reset_at = now + STORE_RESET_AFTER
            return
        for w in self.inproc.waiting:
            self.inproc.verdict(w, False)
        self.inproc.waiting.clear()
        self._stop(signal.SIGTERM)

    def _on_raised(self, w: Worker) -> None:
        """``w``'s function raised: a consequence of a failure (keep it) or its own."""
        if self.kind is not None:
            self.inproc.verdict(w, self.inproc.restarting is not None)
        elif (
            self.inproc.can_restart()
            and COLLECTIVE_TIMEOUT.search(w.raised)
            and self._timed_out_in_process(w)
        ):
            pass  # its culprit is replaced; it restarts in process
        elif self.inproc.consequence(w):
            self.inproc.waiting.append(w)
            if self.raised_until is None:
                self.raised_until = time.monotonic() + self.cause_wait
        else:
            self._own_failure(w)

    def _own_failure(self, w: Worker) -> None:
        """``w``'s exception is its own: it re-raises, exits, and its exit is the root."""
        self.told_to_fail.add(w.pid)
        self.inproc.verdict(w, False)
        if not self.inproc.waiting:
            self.raised_until = None

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
            if w.res_fd in self.by_res:
                self.sel.unregister(w.res_fd)
                del self.by_res[w.res_fd]
            if w.control is not None and w.control.fileno() in self.inproc.by_fd:
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

    def _read_result(self, w: Worker, *, until_empty: bool = False) -> bool:
        """Read what is in ``w``'s result pipe (closed at its end); whether more may come
        now (``until_empty``: False once the pipe is empty for the moment, too)."""
        try:
            data = os.read(w.res_fd, 1 << 20)
        except BlockingIOError:
            return not until_empty
        except OSError:
            data = b""
        if data:
            w.result += data
            return True
        self.sel.unregister(w.res_fd)
        del self.by_res[w.res_fd]
        os.close(w.res_fd)
        w.res_fd = -1
        return False

    def _close(self) -> None:
        self._release_kept()
        self.router.close()
        for fd in self.by_res:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.inproc.close(self.inproc.kept())
        self.sel.close()

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
            elapsed=root.exited_at - self.started,
            bad_target=bad,
            culprit=self.culprit,
        )
