"""The agent's side of an in-process restart (``rallypoint._worker_side`` is the worker's):
one attempt's control channels and the restart's state machine, its timers included.

Workers that entered ``@rallypoint.restartable`` say so on their control channel
(``_worker_side._control``). When the attempt fails and the caller has restarts left, only
the failed rank must go: the others are told to leave their function (``Interrupt``) and
the attempt ends once each has parked (kept for the next attempt) or exited. One still inside its
function once the restart's grace (``--restart-grace``) is over, or one that never entered a
restartable function, is killed and replaced. An exception a worker's function raises is its own
failure unless the attempt is restarting already or it says a peer vanished (then it
waits for the failure that caused it, on the attempt's one clock for that: ``_peer_loss``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from rallypoint._supervise._output import write_console
from rallypoint._supervise._peer_loss import CauseWait, peer_vanished
from rallypoint._supervise._state import Worker
from rallypoint._worker_side._control import (
    Done,
    Hello,
    Interrupt,
    Message,
    Parked,
    Raised,
    Stop,
    Verdict,
    encode,
    receive,
)

__all__ = ["EXIT_EVENT_WAIT", "SECOND_GRACE", "STORE_RESET_AFTER", "InProcess", "Restarting"]

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


@dataclass(slots=True)
class Restarting:
    """An in-process restart under way: since when, and until when workers may take."""

    reason: str
    until: float


def _tell(worker: Worker, msg: Message) -> None:
    if worker.control is None:
        return
    with contextlib.suppress(OSError):
        worker.control.send(encode(msg))


def _main_thread_running(pid: int) -> bool:
    """Whether process ``pid``'s main thread is on a CPU or waiting for one (it spins, or
    holds the GIL in C code) rather than asleep (blocked in a system call)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_RUNNING
    except psutil.Error:
        return False


class InProcess:
    """Control messages and the in-process restart of one attempt's workers.

    ``grace`` is ``--restart-grace`` in seconds (``None``: this attempt does not restart in
    process); ``causes``, the attempt's clock for its peer losses' wait for a cause (a
    function's peer-loss exception waits until it runs out);
    ``reset_store`` empties the workers' store hosted here (a survivor blocked on it gets
    an error); ``on_restartable`` is called once, when a worker first says it runs a
    restartable function.
    """

    def __init__(
        self,
        workers: list[Worker],
        grace: float | None,
        *,
        causes: CauseWait,
        reset_store: Callable[[], object] | None = None,
        on_restartable: Callable[[], object] | None = None,
    ) -> None:
        self.workers = workers
        self.grace = grace
        self.causes = causes
        self.reset_store = reset_store
        self.on_restartable = on_restartable if grace is not None else None
        self.by_fd = {w.control.fileno(): w for w in workers if w.control is not None}
        self.restarting: Restarting | None = None
        self.waiting: list[Worker] = []
        """Workers whose function raised a peer loss, waiting for its cause..."""
        self.raised_until: float | None = None
        """...until then."""
        self.told_to_fail: set[int] = set()
        """Workers whose raised exception was judged their own (no cause to wait for)."""
        self.vanished: dict[int, float] = {}
        """Workers whose control channel closed before their exit was read: when."""
        self.store_reset_at: float | None = None
        """When the store is emptied, if the attempt lasts that long."""

    # ------------------------------------------------------------------ messages
    def on_readable(self, fd: int, now: float, on_raised: Callable[[Worker], None]) -> bool:
        """Read worker ``fd``'s messages; ``False`` once its end is closed."""
        w = self.by_fd[fd]
        assert w.control is not None
        messages = receive(w.control)
        for msg in messages or []:
            match msg:
                case Hello():
                    w.restartable = True
                case Raised(traceback=text):
                    w.raised = text
                    on_raised(w)
                case Parked():
                    w.parked = True
                case Done():  # later calls run as plain calls: a failure replaces it
                    w.restartable = False
                    w.returned = True
        if messages is None:
            del self.by_fd[fd]
            if w.status is None:
                self.vanished[w.pid] = now
            return False
        return True

    def check_restartable(self) -> None:
        """Call ``on_restartable`` once a worker said it runs a restartable function (the
        attempt asks while it runs)."""
        callback = self.on_restartable
        if callback is not None and any(w.restartable for w in self.workers):
            self.on_restartable = None
            callback()

    def cause_coming(self, now: float) -> bool:
        """Whether a worker's control channel closed (it died) and its exit has not been
        read yet: the exit, a failure's likely cause, comes from the warm process, which may
        be busy for a while (importing ``torch._dynamo`` once the first workers run)."""
        return any(
            w.status is None and now < self.vanished[w.pid] + EXIT_EVENT_WAIT
            for w in self.workers
            if w.pid in self.vanished
        )

    # ------------------------------------------------------------------ verdicts
    def verdict(self, w: Worker, restart: bool) -> None:
        """Answer ``w``'s :class:`Raised`: restart in process, or fail (it re-raises)."""
        if w.raised:
            _tell(w, Verdict(restart))
            w.raised = ""

    def answer_late(self, w: Worker) -> None:
        """``w`` raised once the attempt had ended: it restarts if the attempt does."""
        self.verdict(w, self.restarting is not None)

    def hold_or_fail(self, w: Worker) -> None:
        """``w``'s function raised while the attempt runs: a peer loss waits for its cause
        (until the attempt's clock, ``causes``, runs out), anything else is its own failure."""
        if not peer_vanished(w.raised):
            self.own_failure(w)
            return
        self.waiting.append(w)
        self.raised_until = self.causes.seen(time.monotonic())

    def own_failure(self, w: Worker) -> None:
        """``w``'s exception is its own: it re-raises, exits, and its exit is the root."""
        self.told_to_fail.add(w.pid)
        self.verdict(w, False)
        if not self.waiting:
            self.raised_until = None

    def judge_waiting(self, now: float) -> None:
        """A peer loss whose cause did not come in time is its own failure (one a tick)."""
        if not self.waiting:
            return
        assert self.raised_until is not None
        if now >= self.raised_until and not self.cause_coming(now):
            self.own_failure(self.waiting.pop(0))

    # ------------------------------------------------------------------ restarting
    def can_restart(self) -> bool:
        return self.grace is not None

    def interrupt(self, reason: str, now: float) -> list[Worker]:
        """Tell every restartable worker still inside its function to leave it; returns
        the workers that cannot restart in process (to be stopped as usual).

        Once any worker said it runs a restartable function, one that has not said so yet
        is still in the script's set-up (a replacement, say): it is told too, and finds
        the message when it reaches the function, which it then leaves at once (within
        the restart's grace, or it is replaced). The store is emptied
        :data:`STORE_RESET_AFTER` seconds later."""
        assert self.grace is not None
        self.restarting = Restarting(reason, now + self.grace)
        self.raised_until = None  # whoever waited gets its verdict now
        expected = any(w.restartable for w in self.workers)
        stop = []
        for w in self.workers:
            if w.status is not None or w.parked:
                continue
            if w.returned or not (w.restartable or (expected and w.control is not None)):
                stop.append(w)
                continue
            w.interrupted_at = now
            if w.raised:
                self.verdict(w, True)
            else:
                _tell(w, Interrupt(reason))
        self.waiting.clear()
        if self.reset_store is not None:
            self.store_reset_at = now + STORE_RESET_AFTER
        return stop

    def refuse(self) -> None:
        """The attempt ends without an in-process restart: every waiting worker fails."""
        self.raised_until = None
        for w in self.waiting:
            self.verdict(w, False)
        self.waiting.clear()

    def abandon(self) -> None:
        """A signal or the deadline ends the attempt: every worker goes, restart or not."""
        self.restarting, self.raised_until = None, None

    def stop_all(self) -> None:
        """A Ctrl-C: tell every worker (parked ones too) that the job stops (:class:`Stop`),
        before the signal is forwarded."""
        for w in self.workers:
            if w.status is None:
                _tell(w, Stop())

    def escalate(self, now: float) -> list[Worker]:
        """Run the restart's timers: empty the store when due; return the interrupted
        workers to kill now, still inside their function after the grace period.

        A rank that runs (spins, holds the GIL in C code) goes first; one that sleeps is
        likely blocked in a gloo collective with it, which fails once it is gone: it gets
        :data:`SECOND_GRACE` more seconds."""
        if self.store_reset_at is not None and now >= self.store_reset_at:
            self._reset_store()
        overdue = self._overdue(now)
        if not overdue:
            return []
        running = [w for w in overdue if _main_thread_running(w.pid)]
        if running and len(running) < len(overdue):
            overdue = running
            assert self.restarting is not None
            self.restarting.until = now + SECOND_GRACE
        ranks = ", ".join(str(w.rank) for w in overdue)
        write_console(
            2,
            f"rallypoint: in-process restart: rank(s) {ranks} did not leave the function "
            f"within --restart-grace {self.grace:g} s: replaced\n".encode(),
        )
        return overdue

    def wake_at(self) -> tuple[float | None, float | None]:
        """When the restart's next timer is due (``None``: not set)."""
        return self.raised_until, self.store_reset_at

    def _reset_store(self) -> None:
        """Empty the workers' store: a worker that still waits in it gets an error (each
        interrupted worker cuts its own store connections at once; this is the fallback)."""
        self.store_reset_at = None
        if self.reset_store is None:
            return
        with contextlib.suppress(Exception):  # a fallback: each worker cut its own connections
            self.reset_store()

    def _overdue(self, now: float) -> list[Worker]:
        """Interrupted workers still inside their function after the grace period."""
        r = self.restarting
        if r is None or now < r.until:
            return []
        return [
            w
            for w in self.workers
            if w.status is None
            and not w.parked
            and w.interrupted_at is not None
            and w.signalled is None
        ]

    # ------------------------------------------------------------------ the end
    def kept(self) -> list[Worker]:
        """The parked workers, alive: what the next attempt keeps."""
        if self.restarting is None:
            return []
        return [w for w in self.workers if w.parked and w.status is None]

    def watches(self, w: Worker) -> bool:
        """Whether ``w``'s control channel is still read."""
        return w.control is not None and w.control.fileno() in self.by_fd

    def close(self) -> None:
        """The attempt is over: close the control channels of the workers not kept."""
        keep = {w.pid for w in self.kept()}
        for w in self.workers:
            if w.pid not in keep and w.control is not None:
                w.control.close()
                w.control = None
