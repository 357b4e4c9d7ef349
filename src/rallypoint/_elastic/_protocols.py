"""What the coordinators need from the node's supervisor (``rallypoint._supervise``).

A Protocol, so that a coordinator runs in tests with a fake supervisor on thread-simulated
nodes (``tests/elastic``), the way rendezvous backends run on ``MemoryKV``.
"""

from __future__ import annotations

from typing import Any, Protocol

from rallypoint._supervise._state import GroupInfo, Outcome
from rallypoint._supervise._stop_reasons import AttemptPolicy

__all__ = ["NodeSupervisor"]


class NodeSupervisor(Protocol):
    """One node's workers, one attempt at a time (``_supervise._supervisor.Supervisor``)."""

    @property
    def host(self) -> str:
        """This node's name in summaries and records."""
        ...

    @property
    def nproc(self) -> int:
        """Workers on this node."""
        ...

    @property
    def started(self) -> float:
        """``time.monotonic()`` when this node's launch began."""
        ...

    def init_warm(self) -> None:
        """Wait until workers can be started (idempotent)."""
        ...

    def start_store(self, host: str, port: int) -> int:
        """Host the workers' store on ``host:port`` (0: a free port); returns the port."""
        ...

    def reset_store(self) -> None:
        """An empty workers' store on the same port."""
        ...

    def next_signal(self) -> int | None:
        """A signal the launcher received between attempts, or ``None``."""
        ...

    def signal_pending(self) -> bool:
        """Whether a signal was received and not handled yet (peeks, does not take it)."""
        ...

    def run_attempt(
        self,
        group: GroupInfo,
        number: int,
        policy: AttemptPolicy,
        *,
        restart_in_process: bool = False,
        cause_wait: float | None = None,
    ) -> Outcome:
        """Run the local workers of ``group`` until they are gone (or, with
        ``restart_in_process``, parked for the next attempt: ``Outcome.kept``);
        ``cause_wait``: how long a failure that says a peer vanished waits for its cause,
        all waits together; the outcome's ``Failure.peer_loss`` says what is left."""
        ...

    def start_standby(self, group: GroupInfo) -> None:
        """Start the workers ahead, as a hot spare's (they wait for their ranks)."""
        ...

    def stop_kept(self) -> None:
        """Stop the workers kept for an in-process restart that will not come."""
        ...

    def results(self, outcome: Outcome) -> list[Any]:
        """What the workers of a successful attempt returned, by local rank."""
        ...
