"""The option groups of job-level coordination, stored parsed and validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from rallypoint._core.checks import MAX_SECONDS, check_int, check_seconds

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

    max_restarts: int = 0
    """Restart the workers this many times after a failure (one budget for the whole job)."""
    on_hang: Literal["restart", "fail"] = "restart"
    """What a hang does: restart the workers (counts as a restart) or fail the job."""
    max_same_failure: int | None = 3
    """End the job when the same root cause failed this many attempts in a row (the same
    exception at the same innermost user frame, or the same exit at the same rank);
    ``None``: restart until the budget is spent."""

    max_node_failures: int | None = 2
    """Exclude a node that was the root cause of this many failures in a row, while the
    others are at least ``min_nodes`` (multi-node jobs); ``None``: never."""

    burn_in: bool = False
    """After each round forms, time the nodes' links and exclude a node much slower than
    the median (``_elastic._health._burn_in``)."""

    hot_spare: bool = False
    """A node that waits as a spare starts its workers ahead: they run the script's set-up
    and wait in their ``@rallypoint.restartable`` function for the ranks of the round that
    admits the node."""

    def __post_init__(self) -> None:
        for name in ("burn_in", "hot_spare"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int(self.max_restarts, "max_restarts", minimum=0)
        check_int(self.max_same_failure, "max_same_failure", minimum=1, allow_none=True)
        check_int(self.max_node_failures, "max_node_failures", minimum=1, allow_none=True)
        if self.on_hang not in ("restart", "fail"):
            raise ValueError(f"on_hang must be 'restart' or 'fail', got {self.on_hang!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousOptions:
    """How the nodes of a job find each other (``nnodes`` parsed: ``min_nodes``, ``max_nodes``)."""

    min_nodes: int = 1
    max_nodes: int = 1
    backend: str = "c10d"
    """Rendezvous backend of a multi-node job: ``c10d``, ``etcd``, ``file``, ``static``, or
    an installed plugin's (entry point group ``rallypoint.rendezvous_backends``)."""
    endpoint: str = ""
    """``HOST:PORT`` of the rendezvous store (a path for ``file``)."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """Rendezvous options (``join_timeout``, ``last_call_timeout``, ``keep_alive_interval``...)."""
    node_rank: int | None = None
    """This node's rank with the ``static`` backend."""
    local_addr: str | None = None
    """The address this node gives the others (torchrun's ``--local-addr``): the workers'
    ``MASTER_ADDR`` when this node hosts their store (default: its FQDN; on a single
    node ``master_addr``)."""

    def __post_init__(self) -> None:
        lo = check_int(self.min_nodes, "min_nodes", minimum=1)
        hi = check_int(self.max_nodes, "max_nodes", minimum=lo)
        check_backend(self.backend, "rdzv_backend")
        if not isinstance(self.endpoint, str):
            raise TypeError(
                f"rdzv_endpoint must be 'HOST:PORT', got {type(self.endpoint).__name__}"
            )
        if hi > 1 and self.backend != "file" and not self.endpoint:
            raise ValueError(
                f"nnodes={self.nnodes!r} needs a rendezvous endpoint: pass --rdzv-endpoint "
                "HOST:PORT (rdzv_endpoint=), the same on every node"
            )
        if not isinstance(self.conf, Mapping):
            raise TypeError("rdzv_conf must be a mapping of option names to values")
        check_int(self.node_rank, "node_rank", allow_none=True)
        if self.local_addr is not None and (
            not isinstance(self.local_addr, str) or not self.local_addr.strip()
        ):
            raise ValueError(f"local_addr must be a host name or address, got {self.local_addr!r}")
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

    checks: tuple[str, ...] = ()
    """Shell commands (exit 0: healthy) and ``builtin:disk``/``builtin:gpu``/``builtin:store``,
    run in this order before each round this node joins."""
    timeout: timedelta = timedelta(seconds=60)
    """Most time one check may take; a check still running then is killed and fails."""

    def __post_init__(self) -> None:
        if isinstance(self.checks, str) or not all(isinstance(c, str) for c in self.checks):
            raise TypeError(f"health_check must be a list of commands, got {self.checks!r}")
        for check in self.checks:
            if not check.strip():
                raise ValueError(
                    "health_check needs a shell command or one of "
                    f"{', '.join(BUILTIN_CHECKS)}, got {check!r}"
                )
            if check.strip().startswith("builtin:") and check.strip() not in BUILTIN_CHECKS:
                raise ValueError(
                    f"unknown health check {check.strip()!r}; the built-in checks are "
                    f"{', '.join(BUILTIN_CHECKS)}"
                )
        check_seconds(self.timeout, "health_check_timeout", maximum=MAX_SECONDS)


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
