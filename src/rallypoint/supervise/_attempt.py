"""One attempt's monitor loop: exits, output, results, signals, the deadline and the policy.

Every exit is reported by the warm process the moment it happens; output and result pipes
are read as they fill; signals to the launcher wake the loop through a pipe. The first
failure (by time; a rank that failed only because its peer vanished is a consequence, not
the cause) stops every worker's whole process tree: SIGTERM, then SIGKILL after the grace
period. The loop ends when every worker is gone and its pipes are drained.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from typing import Any

from rallypoint.observe._observer import Observer
from rallypoint.supervise._messages import Exited
from rallypoint.supervise._output import OutputRouter
from rallypoint.supervise._policy import AttemptPolicy
from rallypoint.supervise._signals import SignalQueue
from rallypoint.supervise._state import Failure, Outcome, OutcomeKind, Stop, Worker
from rallypoint.supervise._stop import Stopper
from rallypoint.supervise._summary import bad_target_message, error_info, peer_loss
from rallypoint.supervise._warm import WarmProcess
from rallypoint.supervise._worker import BAD_TARGET_EXIT

__all__ = ["Attempt"]

_DRAIN = 0.5
"""Seconds to keep reading pipes after the last worker exited (its children may hold them)."""


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
        self.by_res = {w.res_fd: w for w in workers}
        self.kind: OutcomeKind | None = None
        self.root: Worker | None = None
        self.signum = 0
        self.reason = ""
        self.kill_at: float | None = None
        self.drain_until: float | None = None
        self.next_poll = time.monotonic() + interval
        self.pending: list[Exited] = warm.read_events() if warm.events else []
        self.sel = selectors.DefaultSelector()

    def run(self) -> Outcome:
        self._register()
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

    def _reap(self, now: float) -> None:
        batch = []
        for exited in self.pending:
            w = self.by_pid.get(exited.pid)
            if w is None or w.status is not None:
                continue
            w.status, w.exited_at = exited.status, now
            self._on_exit(w)
            batch.append(w)
        self.pending = []
        # exits reaped together have no order: a rank that failed because its peer
        # vanished ("Connection closed by peer") is a consequence, not the cause
        batch.sort(key=lambda w: peer_loss(w.error_file))
        for w in batch:
            if w.returncode != 0 and self.kind is None:
                bad = w.returncode == BAD_TARGET_EXIT and bool(bad_target_message(w.error_file))
                self._end(OutcomeKind.BAD_TARGET if bad else OutcomeKind.FAILED)
                self.root = w
                self._stop(signal.SIGTERM)

    def _take_signals(self) -> None:
        while (signum := self.signals.pop()) is not None:
            if self.kind is not OutcomeKind.SIGNAL:
                self.kind, self.signum, self.root = OutcomeKind.SIGNAL, signum, None
                self._stop(signum)

    def _check_deadline(self, now: float) -> None:
        if self.kind is None and self.deadline is not None and now >= self.deadline:
            self._end(OutcomeKind.TIMEOUT)
            self._stop(signal.SIGKILL)

    def _poll(self, now: float) -> None:
        if self.kind is not None or now < self.next_poll:
            return
        self.next_poll = now + self.interval
        running = {w.rank: w.pid for w in self.workers if w.status is None}
        stop: Stop | None = self.policy.poll(running)
        if stop is None and self.observer.hung():
            stop = self.policy.on_hang(running, self.observer.idle_seconds())
        if stop is not None:
            self._end(stop.kind, stop.reason)
            quick = stop.kind in (OutcomeKind.HANG, OutcomeKind.RESTART)
            self._stop(signal.SIGTERM, quick=quick)

    def _escalate(self, now: float) -> None:
        if self.kill_at is not None and now >= self.kill_at:
            self.stopper.kill_trees(self.workers, signal.SIGKILL)
            self.kill_at = now + 1.0

    def _drained(self, now: float) -> bool:
        if any(w.status is None for w in self.workers):
            return False
        if self.drain_until is None:
            self.stopper.kill_trees(self.workers, signal.SIGKILL)  # no orphans, even on success
            self.drain_until = now + _DRAIN
        return (not self.router.fds() and not self.by_res) or now >= self.drain_until

    def _wait(self, now: float) -> None:
        timeout = self.interval
        for t in (self.kill_at, self.deadline if self.kind is None else None, self.drain_until):
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
                    if not self._read_result(self.by_res[fd]):
                        self.sel.unregister(fd)
                        del self.by_res[fd]
                case "signal":
                    self.signals.drain_wake_fd()

    # ------------------------------------------------------------------ helpers
    def _end(self, kind: OutcomeKind, reason: str = "") -> None:
        self.kind, self.reason = kind, reason

    def _stop(self, signum: int, *, quick: bool = False) -> None:
        self.kill_at = self.stopper.stop(self.workers, signum, quick=quick)

    def _on_exit(self, w: Worker) -> None:
        self.observer.forget(w.pid)
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

    def _read_result(self, w: Worker) -> bool:
        try:
            data = os.read(w.res_fd, 1 << 20)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            w.result += data
            return True
        os.close(w.res_fd)
        return False

    def _close(self) -> None:
        self.router.close()
        for fd in self.by_res:
            with contextlib.suppress(OSError):
                os.close(fd)
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
        )
