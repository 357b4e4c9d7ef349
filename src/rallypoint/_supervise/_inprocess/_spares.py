"""Spare workers (``--spare-workers``): processes that ran the script's set-up and wait in
their restartable function until a rank that needs a new process takes one of them; spares
exist for in-process restarts, which replace only the ranks that failed."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from dataclasses import replace

from rallypoint._supervise._output import write_console
from rallypoint._supervise._starter import WorkerStarter
from rallypoint._supervise._state import GroupInfo, Worker
from rallypoint._supervise._stop import Stopper
from rallypoint._supervise._warm._exits import ExitReports
from rallypoint._watch._observer import Observer
from rallypoint._worker_side._control import Hello, receive

__all__ = ["SparePool"]

READY_WAIT = 0.5
"""Seconds a rank that needs a new process waits for a spare still in its set-up."""
_TAIL_BYTES = 4096
"""Most of a dead spare's last output that its report shows."""


class SparePool:
    """This node's waiting spares: started once an attempt's workers run a restartable
    function, handed to the ranks that need a new process, started again as they are used.

    A spare that exits before it takes a rank (its set-up failed: it cannot know its
    ``LOCAL_RANK``, say) is reported with the end of its output, and no spare is started
    after that: the next one would fail the same way.
    """

    def __init__(
        self,
        count: int,
        *,
        starter: WorkerStarter,
        stopper: Stopper,
        exits: ExitReports,
        observer: Observer,
    ) -> None:
        self.count = count
        self.starter, self.stopper, self.exits, self.observer = starter, stopper, exits, observer
        self._waiting: list[Worker] = []
        self.started = 0
        self.failed = False
        self.ready: set[int] = set()
        """Spares that said they reached their restartable function (set-up done)."""

    @property
    def waiting(self) -> list[Worker]:
        """The spares that wait for a rank (a copy)."""
        return list(self._waiting)

    def _set_waiting(self, waiting: list[Worker]) -> None:
        """The one place the waiting spares change: the stopper leaves them alone unless
        they are its targets."""
        self._waiting = waiting
        self.stopper.spare_pids = {w.pid for w in waiting}

    def top_up(self, group: GroupInfo) -> None:
        """Fork spares until ``count`` of them run or wait."""
        self._drop_dead()
        missing = self.count - len(self._waiting)
        if missing <= 0 or self.failed:
            return
        new = self.starter.start_spares(group, self.started, missing)
        self.started += missing
        self._set_waiting([*self._waiting, *new])
        pids = ", ".join(str(w.pid) for w in new)
        write_console(
            2,
            f"rallypoint: {missing} spare worker(s) run the script's set-up now and wait to "
            f"take a replaced rank's place (pids {pids})\n".encode(),
        )
        for w in new:
            self.observer.emit("worker_spare", pid=w.pid)

    def place(self, kept: dict[int, Worker], nproc: int, attempt: int) -> set[int]:
        """Give the local ranks that need a new process to spares whose set-up is done
        (into ``kept``: they get the attempt's environment as kept workers do); returns
        those ranks. A spare still in its set-up :data:`READY_WAIT` seconds later is passed
        over, and the console says so: a set-up that hangs must not hold a rank."""
        self._drop_dead()
        placed = set()
        for local_rank in range(nproc):
            if local_rank in kept or not self._waiting:
                continue
            ready = self._wait_ready()
            if not ready:
                self._tell_busy(attempt, local_rank)
                continue
            spare = ready[0]
            self._set_waiting([w for w in self._waiting if w is not spare])
            kept[local_rank] = replace(spare, local_rank=local_rank)
            placed.add(local_rank)
            write_console(
                2,
                f"rallypoint: attempt {attempt}: local rank {local_rank} goes to spare worker "
                f"{spare.pid} (its set-up ran ahead)\n".encode(),
            )
        return placed

    def _wait_ready(self) -> list[Worker]:
        """The waiting spares whose set-up is done; if none, the first to be done within
        :data:`READY_WAIT` seconds (one that just finished has not said so yet)."""
        deadline = time.monotonic() + READY_WAIT
        while True:
            ready = [w for w in self._waiting if self._ready(w)]
            left = deadline - time.monotonic()
            if ready or left <= 0:
                return ready
            fds = [w.control for w in self._waiting if w.control is not None]
            if not fds:
                return []
            select.select(fds, [], [], left)

    def _ready(self, w: Worker) -> bool:
        """Whether spare ``w`` reached its restartable function (it said ``Hello``)."""
        if w.pid in self.ready:
            return True
        if w.control is not None:
            for msg in receive(w.control) or []:
                if isinstance(msg, Hello):
                    self.ready.add(w.pid)
                    w.restartable = True  # the attempt that takes it will not see this Hello
        return w.pid in self.ready

    def _tell_busy(self, attempt: int, local_rank: int) -> None:
        pids = ", ".join(str(w.pid) for w in self._waiting)
        write_console(
            2,
            f"rallypoint: attempt {attempt}: local rank {local_rank} starts in a new process: "
            f"the spare worker(s) (pids {pids}) are still in the script's set-up\n".encode(),
        )

    def take_all(self) -> list[Worker]:
        """Every waiting spare, to be stopped; the pool keeps none."""
        waiting = self._waiting
        self._set_waiting([])
        return waiting

    def _drop_dead(self) -> None:
        alive = []
        for w in self._waiting:
            if self._alive(w):
                alive.append(w)
            else:
                self._report_dead(w)
        self._set_waiting(alive)

    def _alive(self, w: Worker) -> bool:
        """No exit read for it, and its control channel open."""
        if self.exits.exited(w.pid) or w.control is None:
            return False
        try:
            return w.control.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _report_dead(self, w: Worker) -> None:
        self.exits.pop(w.pid)  # its exit, if read, is told here
        tail = b"".join(_read_what_is_there(fd) for fd in w.pipes)[-_TAIL_BYTES:]
        w.close_channels()
        self.failed = True
        shown = tail.decode(errors="replace").rstrip()
        shown = "\n".join(f"  {line}" for line in shown.splitlines()) or "  (no output)"
        write_console(
            2,
            f"rallypoint: spare worker {w.pid} exited before it took a rank; no more spares "
            "are started (a spare runs the set-up without LOCAL_RANK or RANK). The end of its "
            f"output:\n{shown}\n".encode(),
        )
        self.observer.emit("worker_spare_exit", pid=w.pid)


def _read_what_is_there(fd: int) -> bytes:
    """What a dead process left in its pipe ``fd``, without blocking."""
    if fd < 0:
        return b""
    chunks = []
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)
