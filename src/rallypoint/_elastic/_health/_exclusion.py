"""An excluded agent leaves the job; the agent that hosts the rendezvous store stays to serve it.

Exclusion applies to one agent, the root cause, by its rendezvous identity (address, pid,
a counter), not to its host: other agents there stay, and a new agent started there
later is a new node judged on its own failures. An excluded agent leaves the rendezvous
at once and exits with ``EXIT_EXCLUDED``. When its process serves the rendezvous store
(c10d), leaving would end the job: it stops its workers, leaves the rounds, and keeps
serving the store until the job ends and the last round's nodes are gone.
"""

from __future__ import annotations

import contextlib
import time
from typing import NoReturn

from rallypoint._elastic._errors import NodeExcludedError
from rallypoint._elastic._job import Job
from rallypoint._elastic._records import Decision
from rallypoint._supervise._output import write_console
from rallypoint._watch._observer import Observer

__all__ = ["leave_excluded", "say_host_exclusions"]


def say_host_exclusions(job: Job, host: str) -> None:
    """Before this agent's first round: if an agent on its host was excluded from the job,
    say so once (this one is a new node and joins)."""
    if not job.has_run_store:
        return  # the static backend: no run store before its one round
    for record in job.blocking(job.run.exclusions):
        if record.host == host and record.node != job.node:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.time))
            write_console(
                2,
                f"rallypoint: note: agent {record.node} on this host ({host}) was excluded "
                f"from job {job.run_id!r} at {since}: {record.reason}; exclusion applies to "
                f"that agent, so this one ({job.node}) joins as a new node\n".encode(),
            )


def leave_excluded(
    job: Job, observer: Observer, round_number: int, decision: Decision, host: str, barrier: float
) -> NoReturn:
    """This agent is excluded: leave the rendezvous at once (so the next round does not wait
    for it); serve the store first if this process hosts it; end with exit status 4."""
    observer.emit(
        "exclusion", round=round_number, excluded=job.node, host=host, reason=decision.note
    )
    job.leave()  # done already when this agent decided its own exclusion
    if not job.handler.hosts_store:
        raise NodeExcludedError(f"{decision.note}: this node leaves the job")
    write_console(
        2,
        f"rallypoint: {decision.note}: this node leaves the job, but it hosts the rendezvous "
        "store: it keeps serving it, without workers, until the job ends\n".encode(),
    )
    serve_until_end(job, barrier)
    raise NodeExcludedError(
        f"{decision.note}: this node left the job and served the rendezvous store until the "
        "job ended"
    )


def serve_until_end(job: Job, barrier: float) -> None:
    """Keep this process (and so the store it hosts) alive until the job's status is written
    or the rendezvous is closed, then up to ``barrier`` seconds more while the nodes of the
    job's last round still leave; a signal stops it at once."""
    while not job.run.status():
        with contextlib.suppress(Exception):
            if job.handler.is_closed():
                break
        job.check_signals()
        time.sleep(job.poll_every)
    end = job.run.end()
    if end is None:
        return
    last, nnodes = end
    deadline = time.monotonic() + barrier
    while job.run.leave(last, 0) < nnodes and time.monotonic() < deadline:
        job.check_signals()
        time.sleep(0.02)
