"""A hang's finding: how long no worker reported progress, and which bound held.

``--hang-timeout`` bounds the training loop. ``--setup-timeout`` bounds a set-up (a rank
that has not reported progress yet in the attempt) and a wind-down (a rank or a node of
the attempt finished, and the others save and tear down, reporting nothing either).
:meth:`Idle.line` is the first line of the hang's report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Idle"]


@dataclass(frozen=True, slots=True)
class Idle:
    seconds: float
    """Since the last progress of any worker (or the attempt's start)."""
    setup: Sequence[int] = ()
    """The ranks that have not reported any yet in this attempt."""
    finished: Sequence[int] = ()
    """This node's ranks that finished (exited 0, or their function returned)."""
    nodes: int = 0
    """The nodes whose workers all finished."""

    @property
    def long(self) -> bool:
        """Whether the bound is ``--setup-timeout``: a set-up or a wind-down."""
        return bool(self.setup or self.finished or self.nodes)

    def line(self, where: str = "") -> str:
        """The hang's line (``where``: `` on HOST``)."""
        idle = f"no worker{where} reported progress for {self.seconds:.1f} s"
        bound = "(--setup-timeout)"
        if self.setup:
            some = _ranks(self.setup)
            return f"{idle}, in the set-up: {some} not reported any in this attempt {bound}"
        if self.finished:
            return f"{idle}, in the wind-down: {_ranks(self.finished)} finished {bound}"
        if self.nodes:
            some = f"{self.nodes} nodes have" if self.nodes > 1 else "1 node has"
            return f"{idle}, in the wind-down: {some} finished {bound}"
        return f"{idle} (--hang-timeout)"


def _ranks(ranks: Sequence[int]) -> str:
    listed = ", ".join(map(str, ranks))
    return f"ranks {listed} have" if len(ranks) > 1 else f"rank {listed} has"
