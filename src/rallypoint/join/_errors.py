"""Exceptions raised by :mod:`rallypoint.join`.

One root, :class:`JoinError`, subclasses ``RuntimeError`` so that code written for
``torch.distributed.algorithms.join`` (which raises plain ``RuntimeError``) keeps working::

    RuntimeError
    └── JoinError
        ├── EarlyTerminationError   throw_on_early_termination=True: a rank ran out of inputs
        └── RankFailedError         another rank raised inside its Join context

Bad arguments raise ``ValueError`` / ``TypeError`` with a message that says what to change.
"""

from __future__ import annotations

__all__ = ["EarlyTerminationError", "JoinError", "RankFailedError"]


class JoinError(RuntimeError):
    """Root of the errors raised by :mod:`rallypoint.join`."""


class EarlyTerminationError(JoinError):
    """Uneven inputs were detected with ``throw_on_early_termination=True``.

    The message is torch's, word for word: ``"Rank {r} exhausted all inputs."`` on the rank
    that ran out, ``"Detected at least one rank that exhausted inputs. Throwing across all
    ranks."`` on the others.
    """


class RankFailedError(JoinError):
    """Another rank raised inside the same :class:`~rallypoint.join.Join` context.

    ``rank`` is the rank (in the Join's process group) that failed and ``reason`` the text
    it published (``"ValueError: bad batch"``). The process group is unusable afterwards:
    collectives the failed rank never issued are still pending on this rank.
    """

    def __init__(self, rank: int, reason: str, observer: int) -> None:
        super().__init__(
            f"rank {rank} failed inside the Join context: {reason} "
            f"(detected on rank {observer}; the process group is no longer usable)"
        )
        self.rank = rank
        self.reason = reason
        self.observer = observer

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[int, str, int]]:
        return (type(self), (self.rank, self.reason, self.observer))
