"""The one reader of the warm process's exit reports (``Exited``: a child was reaped).

A report is read once and goes to whoever owns the process: the running attempt, which
watches its workers' pids and takes their exits in the order they came, or, for any other
child (a spare worker, a worker kept between attempts), :attr:`ExitReports.gone`, where the
spare pool, the supervisor and the stopper look it up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rallypoint._supervise._warm._messages import Exited
    from rallypoint._supervise._warm._process import WarmProcess

__all__ = ["ExitReports"]


class ExitReports:
    """Reads the exit reports of ``warm``'s children and hands each to its owner."""

    def __init__(self, warm: WarmProcess) -> None:
        self.warm = warm
        self.gone: dict[int, int] = {}
        """``waitpid`` status by pid, of the exits no attempt watched (until looked up)."""
        self._watched: frozenset[int] = frozenset()
        self._taken: list[Exited] = []

    def fileno(self) -> int:
        """Readable when the warm process sent a report (or anything else)."""
        return self.warm.fileno()

    def read(self, *, socket: bool = True) -> None:
        """Take in the reports the warm process sent. ``socket=False``: only if some were
        set aside while it answered a request (a fork, a store reset), which leaves its
        socket unreadable though they wait; no system call otherwise."""
        if not socket and not self.warm.events:
            return
        for exited in self.warm.read_events():
            if exited.pid in self._watched:
                self._taken.append(exited)
            else:
                self.gone[exited.pid] = exited.status

    # ------------------------------------------------------------------ the attempt's
    def watch(self, pids: Iterable[int]) -> None:
        """Hold the exits of ``pids`` (an attempt's workers) for :meth:`take`."""
        self._watched = frozenset(pids)
        self._taken = []

    def take(self) -> list[Exited]:
        """The watched exits read since the last call, in the order they came."""
        taken, self._taken = self._taken, []
        return taken

    def unwatch(self) -> None:
        """The attempt is over: its workers' exits not taken are dropped (it saw each of
        them leave or park), and the next ones go to :attr:`gone`."""
        self._watched = frozenset()
        self._taken = []

    # ------------------------------------------------------------------ everyone else's
    def exited(self, pid: int) -> bool:
        """Whether an exit of ``pid`` was read outside an attempt's watch."""
        return pid in self.gone

    def pop(self, pid: int) -> int | None:
        """``pid``'s status, once: the caller owns the exit now."""
        return self.gone.pop(pid, None)
