"""The snapshot part's errors: a restore the job agreed on that this rank cannot do, and an
explicit checkpoint that cannot load (which ends the job)."""

from __future__ import annotations

from rallypoint._core.fatal import FatalError

__all__ = ["ExplicitResumeError", "SnapshotError"]


class SnapshotError(RuntimeError):
    """Every rank agreed to restore a snapshot, but this rank cannot load its part of it;
    or ``--snapshot-resume-from`` names a job or a path that offers no checkpoint, or none
    that loads (an explicit choice never becomes a fresh start).

    Raised (rather than returning ``None``) so that this rank does not go on from a
    different step than the others; the job restarts instead. Bad input raises
    ``TypeError``/``ValueError``; anything else degrades with a message and never raises.
    """


class ExplicitResumeError(SnapshotError, FatalError):
    """``--snapshot-resume-from`` names checkpoints of which none loads: the job ends at
    once, with this one line (a restart would find the same files)."""
