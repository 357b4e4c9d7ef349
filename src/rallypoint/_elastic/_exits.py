"""The exit codes of ``rallypoint run``, for schedulers that replace nodes.

A scheduler (SLURM, Kubernetes, a script) reads the agent's exit code to decide what to do
with the node it ran on: 0 success, 1 the job failed, 2 bad usage, 3
(:data:`EXIT_UNHEALTHY`) and 4 (:data:`EXIT_EXCLUDED`) replace the node, 128+N the agent
got signal N. The table of what each means and what to do: docs/multinode.md.
"""

from __future__ import annotations

__all__ = ["EXIT_EXCLUDED", "EXIT_UNHEALTHY"]

EXIT_UNHEALTHY = 3
"""A health check failed on this node: it stayed out of the job (replace the node)."""
EXIT_EXCLUDED = 4
"""This agent is excluded from the job: failures in a row, or slow (replace the node)."""
