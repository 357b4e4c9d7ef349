"""A worker that failed because a peer vanished under it: one rule, one wait.

A rank fails *because* a peer vanished when its error says so (gloo's "Connection closed
by peer", a ``DistNetworkError``: :data:`PEER_LOSS`): a consequence, not a failure of its
own, until its cause had time to show up (a worker of this node that failed for a reason of
its own; across nodes, another node's decision or a node's loss, noticed within the
rendezvous's liveness window). The attempt sees a peer loss as a worker's exit or as an
exception a ``@rallypoint.restartable`` function raised; the coordinator waits after it.
All wait on one clock (:class:`CauseWait`) from the first peer loss seen, for one window
(the liveness window plus :data:`LOCAL_CAUSE_WAIT`): the attempt holds a raised one until
it ends and an exit's for :data:`LOCAL_CAUSE_WAIT` at most; its failure carries the clock
(``Failure.peer_loss``), and the coordinator waits the rest."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rallypoint._watch._flight._final import COLLECTIVE_TIMEOUT

__all__ = ["LOCAL_CAUSE_WAIT", "PEER_LOSS", "CauseWait", "PeerLoss", "peer_vanished"]

PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|Socket Timeout|"
    r"gloo/transport|NCCL"
)
"""Errors a rank gets when a peer vanished mid-collective: a consequence of a failure."""
LOCAL_CAUSE_WAIT = 0.5
"""Seconds an exit with a peer loss waits in its attempt, for a cause on its own node (the
whole window where no other node can be lost)."""


def peer_vanished(text: str) -> bool:
    """Whether an error ``text`` says that a peer vanished mid-collective (:data:`PEER_LOSS`).
    A collective that timed out is not that, though gloo's error names its transport: the
    peers are there, one of them never came (``_watch._flight._final.COLLECTIVE_TIMEOUT``)."""
    return PEER_LOSS.search(text) is not None and COLLECTIVE_TIMEOUT.search(text) is None


@dataclass(frozen=True, slots=True)
class PeerLoss:
    """A failure that says a peer vanished: when its attempt first saw a peer loss, and
    when every wait for its cause ends (``time.monotonic()``)."""

    since: float
    until: float

    def left(self, now: float) -> float:
        return max(0.0, self.until - now)


@dataclass(slots=True)
class CauseWait:
    """One attempt's clock for its peer losses' causes: it starts at the first one seen,
    exited or raised, and runs ``window`` seconds (the liveness window across nodes)."""

    window: float
    since: float | None = None

    def seen(self, now: float) -> float:
        """A peer loss was seen at ``now``: until when its cause is waited for."""
        if self.since is None:
            self.since = now
        return self.since + self.window

    def exit_until(self, now: float) -> float:
        """A worker exited with a peer loss at ``now``: until when its attempt waits."""
        return min(now + LOCAL_CAUSE_WAIT, self.seen(now))

    def failure(self, traceback: str, now: float) -> PeerLoss | None:
        """The clock for the attempt's root failure (its error ``traceback``, its exit
        ``now``); ``None`` when that is a failure of its own."""
        if not peer_vanished(traceback):
            return None
        until = self.seen(now)
        return PeerLoss(until - self.window, until)
