"""``FatalError``: the one failure a worker raises to end the job at once.

It lives here, below every part, so that a library part (the snapshot's restore of an
explicit checkpoint that cannot load, say) can end the job the way a user's code does;
``rallypoint.launcher`` documents it.
"""

from __future__ import annotations

__all__ = ["FatalError"]


class FatalError(Exception):
    """Raise it in a worker to end the job at once: no restart is tried and none of the
    budget is spent (a bad config, a missing file: a restart cannot help). The failure
    summary shows its message. Usage: ``raise rallypoint.FatalError("no such dataset")``."""
