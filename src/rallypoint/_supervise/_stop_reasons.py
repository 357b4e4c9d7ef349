"""What the caller of :meth:`Supervisor.run_attempt` decides while the workers run.

The supervisor notices exits, signals and the deadline on its own; an
:class:`AttemptPolicy` adds the caller's reasons to stop, so that one supervisor serves a
single-node launch and a node of an elastic job alike (composition, not subclassing).
:class:`LocalPolicy` is the single-node one: each tick feeds straggler detection (when
on), and a hang prints the local workers' stacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from rallypoint._supervise._output import write_console
from rallypoint._supervise._state import Culprit, OutcomeKind, Stop
from rallypoint._watch._flight._format import hang_report
from rallypoint._watch._idle import Idle
from rallypoint._watch._observer import Observer
from rallypoint._watch._stragglers._watch import StragglerWatch

__all__ = ["AttemptPolicy", "LocalPolicy", "collective_timeout_reason"]


class AttemptPolicy(Protocol):
    """The caller's part of one attempt; ``running`` maps global rank to pid."""

    def poll(self, running: Mapping[int, int]) -> Stop | None:
        """Called each monitor tick while workers run: a reason to stop them (a restart decided
        elsewhere, a membership change, a lost store), or ``None``."""
        ...

    def nodes_finished(self) -> int:
        """The nodes whose workers all finished (at the last check; 0 on one node)."""
        ...

    def on_hang(self, running: Mapping[int, int], idle: Idle) -> Stop:
        """No worker reported progress for ``idle.seconds``; the workers still run."""
        ...

    def on_collective_timeout(self, running: Mapping[int, int], rank: int) -> Culprit:
        """Rank ``rank`` failed because a collective timed out; ``running`` still run.
        Returns the rank it waited for (its line for the failure summary, ``""`` when not
        known here)."""
        ...


class LocalPolicy:
    """One node on its own: stragglers among its ranks are reported; a hang prints the
    workers' stacks, grouped, and stops them."""

    def __init__(
        self,
        observer: Observer,
        *,
        attempt: int,
        on_hang: str,
        stragglers: StragglerWatch | None = None,
    ) -> None:
        self.observer = observer
        self.attempt = attempt
        self.action = on_hang
        self.stragglers = stragglers

    def poll(self, running: Mapping[int, int]) -> Stop | None:
        if self.stragglers is not None:
            self.stragglers.tick(running)
        return None

    def nodes_finished(self) -> int:
        return 0

    def on_hang(self, running: Mapping[int, int], idle: Idle) -> Stop:
        reason = idle.line()
        self.observer.emit(
            "hang", round=self.attempt, idle_s=round(idle.seconds, 3), action=self.action
        )
        report = hang_report(self.observer.collect(running))
        write_console(2, f"rallypoint: {reason}; stacks:\n{report.text}\n".encode())
        return Stop(OutcomeKind.HANG, reason, report.rank)

    def on_collective_timeout(self, running: Mapping[int, int], rank: int) -> Culprit:
        self.observer.emit("collective_timeout", round=self.attempt, rank=rank)
        text, culprit, culprit_rank = hang_report(self.observer.collect(running))
        write_console(
            2, f"rallypoint: {collective_timeout_reason(rank)}; stacks:\n{text}\n".encode()
        )
        return Culprit(culprit, culprit_rank)


def collective_timeout_reason(rank: int) -> str:
    return f"rank {rank} failed: a collective timed out (Flight Recorder of every rank below)"
