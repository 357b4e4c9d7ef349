"""The agent's side of an in-process restart, within one attempt (``_attempt``).

Workers that entered ``@rallypoint.restartable`` say so on their control channel
(``_control``). When the attempt fails and the caller has restarts left, only the failed
rank must go: the others are told to leave their function (``Interrupt``) and the attempt
ends once each has parked (kept for the next attempt) or exited. One still inside its
function ``restart_grace`` seconds later, or one that never entered a restartable
function, is killed and replaced. An exception a worker's function raises is its own
failure unless the attempt is restarting already or it says a peer vanished (then it
waits for the failure that caused it, as an exit does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from rallypoint._supervise._inprocess._control import (
    Done,
    Hello,
    Interrupt,
    Message,
    Parked,
    Raised,
    Verdict,
    encode,
    receive,
)
from rallypoint._supervise._state import Outcome, Worker
from rallypoint._supervise._summary import peer_vanished

__all__ = ["InProcess", "Restarting", "in_process_line", "main_thread_running"]


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


class InProcess:
    """Control messages and in-process restarts of one attempt's workers."""

    def __init__(self, workers: list[Worker], grace: float | None) -> None:
        self.workers = workers
        self.grace = grace
        """``--restart-grace`` in seconds; ``None``: this attempt does not restart in process."""
        self.by_fd = {w.control.fileno(): w for w in workers if w.control is not None}
        self.restarting: Restarting | None = None
        self.waiting: list[Worker] = []
        """Workers whose function raised a peer loss, waiting for its cause."""

    # ------------------------------------------------------------------ messages
    def on_readable(self, fd: int, on_raised: Callable[[Worker], None]) -> bool:
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
            return False
        return True

    def consequence(self, w: Worker) -> bool:
        """Whether ``w``'s raised exception says a peer vanished (wait for its cause)."""
        return peer_vanished(w.raised)

    def verdict(self, w: Worker, restart: bool) -> None:
        """Answer ``w``'s :class:`Raised`: restart in process, or fail (it re-raises)."""
        if w.raised:
            _tell(w, Verdict(restart))
            w.raised = ""

    # ------------------------------------------------------------------ restarting
    def can_restart(self) -> bool:
        return self.grace is not None

    def interrupt(self, reason: str, now: float) -> list[Worker]:
        """Tell every restartable worker still inside its function to leave it; returns
        the workers that cannot restart in process (to be stopped as usual).

        Once any worker said it runs a restartable function, one that has not said so yet
        is still in the script's set-up (a replacement, say): it is told too, and finds
        the message when it reaches the function, which it then leaves at once (within
        ``restart_grace``, or it is replaced)."""
        assert self.grace is not None
        self.restarting = Restarting(reason, now + self.grace)
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
        return stop

    def overdue(self, now: float) -> list[Worker]:
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

    def kept(self) -> list[Worker]:
        """The parked workers, alive: what the next attempt keeps."""
        if self.restarting is None:
            return []
        return [w for w in self.workers if w.parked and w.status is None]

    def close(self, kept: list[Worker]) -> None:
        """The attempt is over: close the control channels of the workers not kept."""
        keep = {w.pid for w in kept}
        for w in self.workers:
            if w.pid not in keep and w.control is not None:
                w.control.close()
                w.control = None


def main_thread_running(pid: int) -> bool:
    """Whether process ``pid``'s main thread is on a CPU or waiting for one (it spins, or
    holds the GIL in C code) rather than asleep (blocked in a system call)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_RUNNING
    except psutil.Error:
        return False


def in_process_line(outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """What an in-process restart keeps and replaces, in one line and as event fields:
    ``ranks 0, 2, 3 kept (pids 11, 12, 13); rank 1 replaced (was killed by SIGKILL)``."""
    kept = sorted(outcome.kept, key=lambda w: w.rank)
    pids = {w.pid for w in kept}
    replaced = sorted((w for w in outcome.workers if w.pid not in pids), key=lambda w: w.rank)
    ranks = ", ".join(str(w.rank) for w in kept)
    pids_text = ", ".join(str(w.pid) for w in kept)
    many = "s" if len(kept) > 1 else ""
    line = f"rank{many} {ranks} kept (pid{many} {pids_text})"
    if replaced:
        line += "; " + "; ".join(f"rank {w.rank} replaced ({w.detail})" for w in replaced)
    fields = {
        "kept": [w.rank for w in kept],
        "replaced": [w.rank for w in replaced],
    }
    return line, fields
