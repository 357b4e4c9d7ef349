"""How a worker and a job ended: the words every part writes (summaries, events, the run
store) and reads back (the timeline report), as string enums so that JSON and the screen
keep the same words."""

from __future__ import annotations

import enum

__all__ = ["JobStatus", "WorkerStatus"]


class WorkerStatus(enum.StrEnum):
    """One worker's state at the end of an attempt (or now)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """It raised, exited non-zero or died by a signal of its own."""
    TERMINATED = "terminated"
    """rallypoint stopped it (a failure elsewhere, a restart, a signal to the launcher)."""
    RUNNING = "running"
    KEPT = "kept"
    """It left its ``@rallypoint.restartable`` function and waits, alive, for the next
    attempt (an in-process restart)."""


class JobStatus(enum.StrEnum):
    """How a job ended, as its ``job_end`` event and the run store say."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    """The launcher got a signal and stopped the job."""
