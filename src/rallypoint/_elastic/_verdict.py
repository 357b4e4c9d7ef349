"""The end of a failed job on every node: the same root cause, the same error.

The node that decided the round writes the root cause (the earliest failure record of the
round, or none after a hang or a timeout); every node reads it and raises the same error,
with the failure screen of the node where it happened.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NoReturn

from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._records import Decision, RootRecord
from rallypoint._elastic._round import Round
from rallypoint._supervise._errors import BadTargetError, HangError, WorkerFailedError
from rallypoint._supervise._state import Outcome, OutcomeKind
from rallypoint._supervise._summary import format_summary, stopped_with_the_job

__all__ = ["ROOT_WAIT", "raise_failure", "root_cause"]

ROOT_WAIT = timedelta(seconds=30)
"""How long a node waits for the deciding node to write the root cause."""


def root_cause(rnd: Round) -> RootRecord:
    """The round's root cause: written by the node that decided, read by every node."""
    if rnd.claimed:
        root = RootRecord(rnd.store.earliest_failure(rnd.nnodes))
        rnd.store.publish_root(root)
        return root
    return rnd.store.root(ROOT_WAIT)


def _culprit(rnd: Round, outcome: Outcome) -> str:
    """The culprit the node that reported the collective timeout named (this one, or
    another through the run store)."""
    if outcome.failure is not None and outcome.failure.culprit:
        return outcome.failure.culprit
    try:
        return rnd.job.run.culprit(rnd.number)
    except Exception:  # the store is gone: the summary goes without it
        return ""


def raise_failure(
    rnd: Round,
    outcome: Outcome,
    decision: Decision,
    root: RootRecord,
    *,
    title: str,
    one_node: bool = False,
) -> NoReturn:
    """Raise the job's error on this node: the same root cause as on every other node. A
    job of one node names the worker by its process, counts attempts, and carries the
    worker's exception (its ``__cause__``)."""
    failure = root.failure
    if failure is None:
        if outcome.kind is OutcomeKind.HANG:
            raise HangError(f"{decision.reason}; stopped the workers {_hang_end(rnd, one_node)}")
        raise RendezvousFailedError(f"the job failed: {decision.reason}")
    local = outcome.failure if one_node else None
    if outcome.kind is OutcomeKind.BAD_TARGET:
        raise BadTargetError(local.bad_target if local else failure.traceback or failure.detail)
    worker = local.worker if local else failure.worker_state()
    others = stopped_with_the_job([w for w in outcome.workers if w.pid != worker.pid])
    budget = rnd.job.restarts.max_restarts
    if not budget:
        attempts = "no restarts"
    elif one_node:
        attempts = f"attempt {rnd.number + 1} of {budget + 1}"
    else:  # spent before this round's end: less where it ended early
        attempts = f"{decision.count} restart(s) used of {budget}"
    summary = format_summary(
        title=title,
        root=worker,
        host=failure.host,
        when=failure.time,
        elapsed=failure.elapsed,
        traceback_text=failure.traceback,
        others=others,
        attempts=attempts,
        culprit=_culprit(rnd, outcome),
    )
    where = (
        f"(local_rank {failure.local_rank}, pid {failure.pid})"
        if one_node
        else f"on {failure.host}"
    )
    err = WorkerFailedError(
        f"rank {failure.rank} {where} {failure.detail}",
        rank=failure.rank,
        local_rank=failure.local_rank,
        pid=failure.pid,
        host=failure.host,
        exitcode=failure.exitcode,
        remote_traceback=failure.traceback,
        summary=summary,
        others=tuple(others),
        exception=local.exception if local else None,
    )
    if local is not None and local.exception is not None:
        raise err from local.exception
    raise err


def _hang_end(rnd: Round, one_node: bool) -> str:
    if not one_node:
        return "on every node"
    return "(--on-hang fail)" if rnd.job.restarts.on_hang == "fail" else "(no restarts left)"
