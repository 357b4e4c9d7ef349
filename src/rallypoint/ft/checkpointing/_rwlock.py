"""torchft's ``checkpointing._rwlock`` path for the readers-writer lock (its tests import it
there); the lock is :mod:`rallypoint.ft._state.rwlock`, which the manager uses too."""

from rallypoint.ft._state.rwlock import RWLock

__all__ = ["RWLock"]
