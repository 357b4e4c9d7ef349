"""The exit codes of ``rallypoint run``, for schedulers that replace nodes.

A scheduler (SLURM, Kubernetes, a script) reads the agent's exit code to decide what to do
with the node it ran on:

==== ======================= =================================================================
code name                    meaning, and what a scheduler should do
==== ======================= =================================================================
0    (success)               the job finished; nothing to do
1    (failure)               the job failed (root cause on the screen); fix the job, not the node
2    (usage)                 bad command line or options; fix the command
3    ``EXIT_UNHEALTHY``      a ``--health-check`` failed on this node before it joined a
                             round: the node stayed out, the others go on at MIN or more
                             nodes; drain this node and start a replacement agent elsewhere
4    ``EXIT_EXCLUDED``       this agent was the root cause of ``--max-node-failures``
                             failures in a row, or the ``--burn-in`` found it much slower
                             than the others: it is on the job's exclusion list (the agent,
                             not its host: a new agent there joins as a new node); drain the
                             node and start a replacement agent elsewhere
128+N (signal)               the agent got signal N (SIGTERM: 143) and stopped its workers
==== ======================= =================================================================
"""

from __future__ import annotations

__all__ = ["EXIT_EXCLUDED", "EXIT_UNHEALTHY"]

EXIT_UNHEALTHY = 3
"""A health check failed on this node: it stayed out of the job (replace the node)."""
EXIT_EXCLUDED = 4
"""This agent is excluded from the job: failures in a row, or slow (replace the node)."""
