"""The errors of a multi-node job's coordination, exported by ``rallypoint.launcher``:
the rendezvous failed, this node is excluded, or its health check failed. They derive from
``LaunchError`` (``rallypoint._supervise._errors``), the root of the launcher's tree."""

from __future__ import annotations

from rallypoint._supervise._errors import LaunchError

__all__ = ["NodeExcludedError", "RendezvousFailedError", "UnhealthyNodeError"]


class RendezvousFailedError(LaunchError):
    """The multi-node rendezvous could not complete, lost its store, or was closed."""


class NodeExcludedError(RendezvousFailedError):
    """This node was the root cause of ``max_node_failures`` failures in a row and is kept
    out of the job (the others go on), or the burn-in found it much slower than the others;
    ``rallypoint run`` exits with ``EXIT_EXCLUDED`` (4) so that a scheduler can replace the
    node."""


class UnhealthyNodeError(LaunchError):
    """A health check (``health_check``) failed on this node before it joined a round: the
    node stayed out of the job. ``check`` names the check; the message is the screen
    (its exit code or timeout and the last lines of its output). ``rallypoint run`` exits
    with ``EXIT_UNHEALTHY`` (3) so that a scheduler can replace the node."""

    def __init__(self, message: str, *, check: str) -> None:
        super().__init__(message)
        self.check = check
