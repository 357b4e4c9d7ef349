"""One round of a job as this node sees it, and the restart policy: the one decision
about the round's fate.

:meth:`Round.judge` turns the outcome of this node's attempt into a claim (what it spends,
whether it must end the job); :meth:`Round.claim` applies the budget, the same-failure
limit and the exclusion of a node that keeps failing. The first node to claim the round
decides it; the decision is written by compare-and-set, so that when the claiming node is
lost before it writes one (its heartbeats stop), another node can write a restart instead
and nobody waits out the store's ``read_timeout`` (:meth:`Round.decision`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._job import Job
from rallypoint._elastic._records import Action, Decision, ExclusionRecord
from rallypoint._elastic._signature import failure_signature, repeated_line
from rallypoint._elastic._stores import RoundStore
from rallypoint._supervise._state import GroupInfo, Outcome, OutcomeKind

__all__ = ["TAKEOVER_AFTER", "Round"]

TAKEOVER_AFTER = 5.0
"""Seconds a node waits for the claimed round's decision before a lost member (a node
whose heartbeats stopped, the claimer perhaps) lets it decide a restart itself; writing a
decision takes a few store round trips."""


@dataclass(slots=True)
class Round:
    """Round ``number``: this node's group, the members' hosts, and the round's store."""

    number: int
    group: GroupInfo
    members: list[str]
    store: RoundStore
    job: Job
    claimed: bool = field(default=False)
    """Whether this node wrote the round's decision (then it also writes the root cause)."""

    @property
    def nnodes(self) -> int:
        return self.group.group_world_size

    @property
    def group_rank(self) -> int:
        return self.group.group_rank

    def judge(self, outcome: Outcome, *, host: str, one_node: bool) -> None:
        """Claim the round for the outcome of this node's attempt (the first claim wins):
        a timeout ends the job; a failure spends a restart, unless it cannot be restarted
        (a bad target, ``FatalError``); a hang spends one or ends the job (``on_hang``).
        A failure names this node (on ``host``) for the exclusion rule, unless the job has
        ``one_node`` (never excluded). Other outcomes claim nothing here: a signal or a
        lost store ends this node, a success waits for the others, a restart was decided
        already, and a membership change claims without spending (the caller's)."""
        kind = outcome.kind
        if kind is OutcomeKind.TIMEOUT:
            self.claim("the job ran past --timeout", spend=True, force_fail=True)
        elif kind is OutcomeKind.HANG:  # a multi-node job's policy claimed it already
            fail = self.job.restarts.on_hang == "fail"
            self.claim(outcome.reason, spend=True, force_fail=fail)
        elif kind in (OutcomeKind.FAILED, OutcomeKind.BAD_TARGET, OutcomeKind.FATAL):
            assert outcome.failure is not None
            failure, fatal = outcome.failure, kind is OutcomeKind.FATAL
            w = failure.worker
            self.claim(
                f"rank {w.rank} {w.detail}" if one_node else f"rank {w.rank} on {host} {w.detail}",
                spend=True,
                force_fail=kind is OutcomeKind.BAD_TARGET or fatal,
                signature=failure_signature(w.rank, w.detail, failure.traceback),
                note=f"rank {w.rank} raised FatalError; not restarting" if fatal else "",
                node="" if one_node else self.job.node,
                host=host,
            )

    def claim(
        self,
        reason: str,
        *,
        spend: bool,
        force_fail: bool = False,
        signature: str = "",
        note: str = "",
        node: str = "",
        host: str = "",
    ) -> None:
        """Decide the round's fate once for the whole job (the first claim wins).

        ``spend`` counts a restart against the job's budget; with the budget spent, or with
        ``force_fail``, the decision is to fail. Membership changes do not spend. A
        failure's ``signature`` (``_signature``) that ended ``max_same_failure``
        rounds in a row fails the job too. ``note`` says why a failure is not restarted
        (every node prints it). The ``node`` (on ``host``) where the failure happened is
        excluded once it was the root cause of ``max_node_failures`` rounds in a row: the
        others restart without it, spending nothing, or the job ends if that would leave
        fewer than ``min_nodes``.
        """
        if not self.store.claim():
            return
        excluded = ""
        if spend and not force_fail:
            strikes = self.job.run.node_failed(node)
            excluded, note, force_fail = self._exclusion(node, host, strikes)
            if excluded:
                spend = False
                self.job.run.same_failure("")  # another world: the run starts again
        if spend and not force_fail:
            same = self.job.restarts.max_same_failure
            streak = self.job.run.same_failure(signature)
            if signature and same is not None and streak >= same:
                force_fail = True
                note = note or repeated_line(signature, streak, same)
        limit = self.job.restarts.max_restarts
        count = self.job.run.restarts(1 if spend and not force_fail else 0)
        fail = force_fail or (spend and count > limit)
        decision = Decision(
            action=Action.FAIL if fail else Action.RESTART,
            reason=reason,
            count=min(count, limit),
            by=self.group_rank,
            note=note,
            excluded=excluded,
        )
        self._decide(decision)

    def decision(self) -> Decision:
        """The round's decision, once written. While there is none after
        :data:`TAKEOVER_AFTER` and a member is lost (the node that claimed the round, gone
        before it wrote one), this node writes a restart without spending budget (the
        membership changed); with no decision and no lost member within the store's
        ``read_timeout``, :class:`RendezvousFailedError`."""
        start = time.monotonic()
        while not self.store.decided():
            waited = time.monotonic() - start
            if waited >= TAKEOVER_AFTER and self.job.nodes_waiting() > 0:
                return self.store.decide(
                    Decision(
                        action=Action.RESTART,
                        reason=f"a node was lost before it decided round {self.number}",
                        count=self.job.run.restarts(0),
                        by=self.group_rank,
                    )
                )
            if waited >= self.job.store_timeout:
                raise RendezvousFailedError(
                    f"round {self.number} was claimed but not decided within "
                    f"{self.job.store_timeout:g} s (read_timeout); this node stopped"
                )
            self.job.check_signals()
            time.sleep(self.job.poll_every)
        return self.store.decision()

    def _exclusion(self, node: str, host: str, strikes: int) -> tuple[str, str, bool]:
        """``(excluded node, note, force_fail)`` for a failure rooted on ``node`` for the
        ``strikes``-th round in a row."""
        limit = self.job.restarts.max_node_failures
        if not node or limit is None or strikes < limit:
            return "", "", False
        why = f"the root cause of {strikes} failures in a row (--max-node-failures {limit})"
        left = self.nnodes - 1
        if left < self.job.min_nodes:
            return (
                "",
                (
                    f"node {node} (host {host}) was {why}, but without it {left} node(s) would "
                    f"be left, fewer than the minimum of {self.job.min_nodes} (--nnodes): "
                    "ending the job"
                ),
                True,
            )
        return node, self._exclude(node, host, why), False

    def _exclude(self, node: str, host: str, why: str) -> str:
        """Put the agent ``node`` on the job's exclusion list (not its host: other agents
        there stay); returns the line every node says."""
        self.job.run.exclude(ExclusionRecord(node=node, host=host, reason=why, time=time.time()))
        left = self.nnodes - 1
        return f"excluded node {node} (host {host}): {why}; the job goes on with {left}"

    def exclude_now(self, node: str, host: str, why: str) -> None:
        """Decide the round (if first) to restart without ``node``, spending nothing: the
        burn-in found it slow (the caller checked that MIN nodes remain)."""
        if not self.store.claim():
            return
        decision = Decision(
            action=Action.RESTART,
            reason=f"burn-in: node {node} (host {host}) is slow",
            count=self.job.run.restarts(0),
            by=self.group_rank,
            note=self._exclude(node, host, why),
            excluded=node,
        )
        self._decide(decision)

    def _decide(self, decision: Decision) -> None:
        """Write this node's decision. An agent that excludes itself (the root cause of the
        failures, or the slow one) leaves the rendezvous first, so that the others, who
        restart once they read the decision, never count on it in the next round."""
        if decision.excluded == self.job.node:
            self.job.leave()
        self.claimed = self.store.decide(decision) == decision
