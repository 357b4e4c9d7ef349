"""Test support: a forked multi-process runner, fakes and contract suites.

Public names:

- :func:`run_workers` / :class:`WorkerError`: run a function in N forked processes with a
  launcher-like environment and a deadline.
"""

from __future__ import annotations

from rallypoint.testing._workers import WorkerError, run_workers

__all__ = ["WorkerError", "run_workers"]
