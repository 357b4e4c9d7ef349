"""A step's collectives ahead of its quorum: on the group the last step committed on,
while this step's round trip to the lighthouse is still under way.

In a steady run the quorum does not change from one step to the next, and learning so
takes a round trip (ask, decide, read) that the collectives need not wait for. A
collective that finds this step's quorum not decided yet runs on the last step's group
when this member took part in that step, nobody sat it out, and it committed. The commit
checks the guess: if the step's quorum is another one (a group left or joined), the step
is voted down as one that failed, and the next step runs on the new group. A change of
quorum costs one step more; a steady step saves the round trip.

A source whose guess missed keeps serving its state after the step is voted down (the
state is as it was: nothing stepped): the group that heals from it in that round may not
have fetched it yet, and would otherwise wait out its timeout. Its next commit ends it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

from rallypoint.ft._plan import Plan
from rallypoint.ft._quorum.watch import Ending, GroupGuard, Key

__all__ = ["Ahead", "Basis"]


@dataclass(frozen=True, slots=True)
class Basis:
    """A configured group and what its quorum means for this member."""

    key: Key
    plan: Plan
    ending: Ending


class Ahead:
    """One manager's guesses: ``ready`` is the group its last quorum configured (set by the
    quorum thread), ``taken`` the one this step's collectives ran on ahead of its quorum."""

    def __init__(self) -> None:
        self.ready: Basis | None = None
        self.taken: Basis | None = None
        self.steps_ahead = 0
        """Steps whose collectives ran ahead of their quorum (a count for tests and tuning)."""
        self.steps_missed = 0
        """Of those, the ones whose quorum turned out another: voted down."""

    def new_step(self) -> None:
        self.taken = None

    def basis(
        self, future: concurrent.futures.Future[None] | None, guard: GroupGuard, committed: bool
    ) -> Basis | None:
        """The group a collective may run on now without waiting for the quorum
        (``None``: it waits)."""
        if self.taken is not None:  # every collective of a step runs on the same group
            return self.taken
        ready = self.ready
        if future is None or future.done() or ready is None or not committed:
            return None
        plan = ready.plan
        if plan.heal or plan.others or plan.participating_rank is None:
            return None
        if guard.configured != ready.key or guard.ending is not ready.ending:
            return None  # aborted, or replaced by now
        self.taken = ready
        self.steps_ahead += 1
        return ready

    def settle(
        self, future: concurrent.futures.Future[None], report: Callable[[Exception], None]
    ) -> bool:
        """At the commit: wait for this step's quorum (a failure to get it is raised here
        when the collectives ran ahead of it, as their wait would have), and ``report`` a
        guess that missed, which fails the step; whether it missed."""
        try:
            future.result()
        except Exception:
            if self.taken is not None:
                raise
            return False
        taken, ready = self.taken, self.ready
        if taken is None or ready is None:
            return False
        if ready.key == taken.key and ready.plan.participants == taken.plan.participants:
            return False
        self.steps_missed += 1
        report(
            RuntimeError(
                "this step's collectives ran on the last quorum's group and the quorum "
                "changed meanwhile: the step is voted down, the next runs on the new group"
            )
        )
        return True
