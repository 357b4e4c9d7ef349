"""The option groups of job-level coordination, stored parsed and validated.

``LaunchConfig`` declares each option once (its default, its check, its help) and gives
these groups the checked values; a group checks only the rules between its fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

__all__ = [
    "BACKENDS",
    "BUILTIN_CHECKS",
    "HealthOptions",
    "RendezvousOptions",
    "RestartOptions",
    "check_backend",
    "parse_nnodes",
]

BACKENDS = ("c10d", "etcd", "etcd-v3", "file", "static")
"""The built-in rendezvous backends; plugins add theirs (:func:`check_backend`)."""
BUILTIN_CHECKS = ("builtin:disk", "builtin:gpu", "builtin:store")
"""The health checks rallypoint runs itself (``_elastic._health``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartOptions:
    """What a failure or a hang does to the job."""

    max_restarts: int
    """Restart the workers this many times after a failure (one budget for the whole job)."""
    on_hang: Literal["restart", "fail"]
    """What a hang does: restart the workers (counts as a restart) or fail the job."""
    max_same_failure: int | None
    """End the job when the same root cause failed this many attempts in a row (the same
    exception at the same innermost user frame, or the same exit at the same rank);
    ``None``: restart until the budget is spent."""

    max_node_failures: int | None
    """Exclude a node that was the root cause of this many failures in a row, while the
    others are at least ``min_nodes`` (multi-node jobs); ``None``: never."""

    burn_in: bool
    """After each round forms, time the nodes' links and exclude a node much slower than
    the median (``_elastic._health._burn_in``)."""

    hot_spare: bool
    """A node that waits as a spare starts its workers ahead: they run the script's set-up
    and wait in their ``@rallypoint.restartable`` function for the ranks of the round that
    admits the node."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousOptions:
    """How the nodes of a job find each other (``nnodes`` parsed: ``min_nodes``, ``max_nodes``)."""

    min_nodes: int
    max_nodes: int
    backend: str
    """Rendezvous backend of a multi-node job: ``c10d``, ``etcd``, ``file``, ``static``, or
    an installed plugin's (entry point group ``rallypoint.rendezvous_backends``)."""
    endpoint: str
    """``HOST:PORT`` of the rendezvous store (a path for ``file``)."""
    conf: Mapping[str, str]
    """Rendezvous options (``join_timeout``, ``last_call_timeout``, ``keep_alive_interval``...)."""
    node_rank: int | None
    """This node's rank with the ``static`` backend."""
    local_addr: str | None
    """The address this node gives the others (torchrun's ``--local-addr``): the workers'
    ``MASTER_ADDR`` when this node hosts their store (default: its FQDN; on a single
    node ``master_addr``)."""

    def __post_init__(self) -> None:
        lo, hi = self.min_nodes, self.max_nodes
        if hi > 1 and self.backend != "file" and not self.endpoint:
            raise ValueError(
                f"nnodes={self.nnodes!r} needs a rendezvous endpoint: pass --rdzv-endpoint "
                "HOST:PORT (rdzv_endpoint=), the same on every node"
            )
        if self.backend == "static" and hi > 1:
            if self.node_rank is None or not 0 <= self.node_rank < hi:
                raise ValueError(
                    f"the static rendezvous needs --node-rank in [0, {hi}), got {self.node_rank}"
                )
            if lo != hi:
                raise ValueError(f"the static rendezvous needs a fixed --nnodes, got {lo}:{hi}")

    @property
    def nnodes(self) -> str:
        """``N`` or ``MIN:MAX``, as on the command line."""
        return (
            str(self.min_nodes)
            if self.min_nodes == self.max_nodes
            else f"{self.min_nodes}:{self.max_nodes}"
        )

    @property
    def multi_node(self) -> bool:
        """Whether the job runs the elastic coordinator (a rendezvous of several nodes)."""
        return self.max_nodes > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthOptions:
    """What this node checks before it joins a round (``_elastic._health``)."""

    checks: tuple[str, ...]
    """Shell commands (exit 0: healthy) and ``builtin:disk``/``builtin:gpu``/``builtin:store``,
    run in this order before each round this node joins."""
    timeout: timedelta
    """Most time one check may take; a check still running then is killed and fails."""


def check_backend(name: object, what: str) -> str:
    """``name`` if the rendezvous registry knows it (a built-in backend, one registered in
    this process, or an installed plugin's); else ``ValueError`` listing the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a backend name, got {type(name).__name__}")
    if name in BACKENDS:
        return name
    from rallypoint.rendezvous import rendezvous_handler_registry as registry

    if not registry.is_available(name):
        known = ", ".join(registry.available())
        raise ValueError(
            f"{what} {name!r} is not a rendezvous backend; known: {known} (a plugin adds its "
            "own through the entry point group rallypoint.rendezvous_backends)"
        )
    return name


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` as ``(min, max)``; ``ValueError`` otherwise."""
    text = str(value)
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"nnodes must be N or MIN:MAX, got {text!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if not 0 < lo <= hi:
        raise ValueError(f"nnodes must satisfy 0 < MIN <= MAX, got {text!r}")
    return lo, hi
