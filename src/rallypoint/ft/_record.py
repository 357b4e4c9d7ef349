"""A replica group's quorum changes and heals, in its agent's ``--events`` file.

``rallypoint run --events FILE`` tells its workers where the file is
(``RALLYPOINT_EVENTS_FILE``); each group's rank 0 appends one ``quorum`` event for every
new quorum it takes part in and one ``heal`` event for every heal, beside the agent's own
events. ``rallypoint report`` draws each group's participation from them. An event that
cannot be written never fails a step: it is dropped, said once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rallypoint._core.envvars import EVENTS_FILE, EVENTS_NODE
from rallypoint.ft._quorum.records import Quorum, changes
from rallypoint.observe import EventLog

__all__ = ["GroupEvents"]


class GroupEvents:
    """Writes one group's ``quorum`` and ``heal`` events (nothing without ``--events``)."""

    def __init__(self, replica_id: str, rank: int) -> None:
        self.replica_id = replica_id
        self._previous: Quorum | None = None
        self._log: EventLog | None = None
        path = os.environ.get(EVENTS_FILE, "")
        if rank == 0 and path:
            try:
                self._log = EventLog(path, node=os.environ.get(EVENTS_NODE) or None)
            except ValueError as exc:
                _drop(exc)

    def quorum(self, quorum: Quorum, healing: bool) -> None:
        """A quorum this group is in; written when it differs from the last one."""
        previous, self._previous = self._previous, quorum
        if self._log is None or (previous is not None and previous.quorum_id == quorum.quorum_id):
            return
        left, joined = changes(quorum, previous)
        self._emit(
            "quorum",
            group=self.replica_id,
            quorum=quorum.quorum_id,
            step=max(m.step for m in quorum.members),
            groups=[m.replica_id for m in quorum.members],
            left={g: why for g, why in left},
            joined={g: step for g, step in joined},
            healing=healing,
        )

    def heal(self, source: str, step: int, size: int, seconds: float) -> None:
        """This group fetched ``size`` bytes of state from group ``source`` at ``step``."""
        self._emit(
            "heal",
            group=self.replica_id,
            source=source,
            step=step,
            bytes=size,
            seconds=round(seconds, 4),
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._log is None:
            return
        try:
            self._log.emit(kind, **fields)
        except (OSError, ValueError, TypeError) as exc:
            log, self._log = self._log, None
            log.close()
            _drop(exc)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _drop(exc: BaseException) -> None:
    sys.stderr.write(
        f"rallypoint.ft: warning: writing the group's events ({os.environ.get(EVENTS_FILE)}) "
        f"failed: {exc}; training goes on\n"
    )
