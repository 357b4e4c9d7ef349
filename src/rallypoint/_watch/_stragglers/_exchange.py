"""What the judging node does with every node's records in the run store, step-time
summaries (``_watch``) and arrival samples (``_arrival_watch``) alike: read the ones that
are there, and count only those that still move.

Each node writes its record under its group rank with a ``seq`` that grows with every
sample; a record whose ``seq`` did not change for :data:`STALE_AFTER` periods (its node's
workers finished, or the node is gone) no longer counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rallypoint._core.store import Store

__all__ = ["STALE_AFTER", "Freshness", "read_present"]

STALE_AFTER = 3
"""Periods without a new record after which a node's record no longer counts."""


def read_present(store: Store, keys: Mapping[int, str]) -> dict[int, bytes]:
    """``{group rank: record}`` of the ``keys`` (by group rank) that are in the store: one
    ``check`` and one ``multi_get`` when every node has written, else a ``check`` each."""
    if not keys:
        return {}
    present = list(keys)
    if not store.check(list(keys.values())):  # some node has not written yet
        present = [g for g, key in keys.items() if store.check([key])]
    raws = store.multi_get([keys[g] for g in present]) if present else []
    return {g: bytes(raw) for g, raw in zip(present, raws, strict=True)}


class Freshness:
    """Which nodes' records still move (see the module docstring); ``every``: the period."""

    def __init__(self, every: float, clock: Callable[[], float]) -> None:
        self.every = every
        self._clock = clock
        self._seen: dict[int, tuple[int, float]] = {}  # group rank -> (seq, when it moved)

    def fresh(self, group_rank: int, seq: int) -> bool:
        """Whether node ``group_rank``'s record, at ``seq`` now, still counts."""
        now = self._clock()
        last, since = self._seen.get(group_rank, (-1, now))
        if seq != last:
            self._seen[group_rank] = (seq, now)
            since = now
        return now - since <= STALE_AFTER * self.every
