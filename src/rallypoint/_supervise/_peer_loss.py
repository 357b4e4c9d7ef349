"""A worker that failed because a peer vanished under it (gloo's "Connection closed by
peer", a ``DistNetworkError``: :data:`PEER_LOSS`): a consequence, not a failure of its own,
until its cause had time to show up. The one rule that tells such a failure, read by the
attempt (an exit or a raised exception) and by the coordinator (the root failure)."""

from __future__ import annotations

import re

from rallypoint._watch._flight._final import COLLECTIVE_TIMEOUT

__all__ = ["PEER_LOSS", "peer_vanished"]

PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|Socket Timeout|"
    r"gloo/transport|NCCL"
)
"""Errors a rank gets when a peer vanished mid-collective: a consequence of a failure."""


def peer_vanished(text: str) -> bool:
    """Whether an error ``text`` says that a peer vanished mid-collective (:data:`PEER_LOSS`).
    A collective that timed out is not that, though gloo's error names its transport: the
    peers are there, one of them never came (``_watch._flight._final.COLLECTIVE_TIMEOUT``)."""
    return PEER_LOSS.search(text) is not None and COLLECTIVE_TIMEOUT.search(text) is None
