"""The snapshot part's one error: a restore the job agreed on that this rank cannot do."""

from __future__ import annotations

__all__ = ["SnapshotError"]


class SnapshotError(RuntimeError):
    """Every rank agreed to restore a snapshot, but this rank cannot load its part of it;
    or ``--snapshot-resume-from`` names a job or a path that offers no checkpoint, or none
    that loads (an explicit choice never becomes a fresh start).

    Raised (rather than returning ``None``) so that this rank does not go on from a
    different step than the others; the job restarts instead. Bad input raises
    ``TypeError``/``ValueError``; anything else degrades with a message and never raises.
    """
