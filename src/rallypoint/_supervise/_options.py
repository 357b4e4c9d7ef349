"""The option groups of one node's supervision, stored parsed and validated.

``LaunchConfig`` (``rallypoint.launcher``) is made of these groups and those of the other
parts; it declares each option once (its default, its check, its help) and turns the flat
options users pass (``nproc=``, ``preload="a,b"``, ``redirects="0:1"``...) into them,
checked. A group takes those values as they are and checks only the rules between its
fields in ``__post_init__`` (``ValueError`` naming the flat options); it is frozen.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeAlias

from rallypoint._supervise._numa import check_numa_binding

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_MONITOR_INTERVAL",
    "SIGNALS",
    "OutputOptions",
    "StdSpec",
    "StopOptions",
    "WorkerOptions",
    "WorldOptions",
    "parse_std_spec",
    "visible_gpus",
]

DEFAULT_PREFIX = "[rank${rank}]: "
"""Default console line prefix; ``${rank}``, ``${local_rank}`` and ``${role_name}`` expand."""

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
"""Signals the launcher may forward to its workers."""

StdSpec: TypeAlias = int | Mapping[int, int]
"""A parsed ``--redirects``/``--tee``: one mask for every local rank, or one per rank."""

_NONE, _ALL = 0, 3


def parse_std_spec(value: str | int | Mapping[int, int], what: str) -> StdSpec:
    """Parse torchrun's ``--redirects``/``--tee`` value.

    ``"3"`` (or ``3``) applies to every local rank; ``"0:1,1:2"`` maps local ranks to a mask
    (1 stdout, 2 stderr, 3 both). Returns an ``int`` or a ``{local_rank: mask}`` dict.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be 0-3 or 'LOCAL_RANK:MASK,...', got {value!r}")
    if isinstance(value, int):
        if not _NONE <= value <= _ALL:
            raise ValueError(f"{what} must be between 0 and 3, got {value}")
        return value
    if isinstance(value, Mapping):
        out: dict[int, int] = {}
        for rank, mask in value.items():
            checked = parse_std_spec(int(mask), what)
            assert isinstance(checked, int)
            out[int(rank)] = checked
        return out
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, int or mapping, got {type(value).__name__}")
    text = value.strip()
    if re.fullmatch(r"[0-3]", text):
        return int(text)
    if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        raise ValueError(
            f"{what} must be 0 (none), 1 (stdout), 2 (stderr), 3 (both) or "
            f"'LOCAL_RANK:MASK,...' such as '0:1,1:3', got {value!r}"
        )
    return {int(r): int(m) for r, m in (item.split(":") for item in text.split(","))}


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """What runs on this node: how many workers, how they start, where, with what."""

    nproc: int
    """Workers on this node (``--nproc-per-node``)."""
    role: str
    start_method: Literal["fork", "spawn"]
    """``fork`` from the warm process, or ``spawn`` a fresh interpreter per worker."""
    preload: tuple[str, ...]
    """Modules the warm process imports before forking (``--preload a,b``)."""
    env: Mapping[str, str]
    """Extra environment variables for the workers."""
    cwd: str | None
    """Working directory of the workers (``None``: the launcher's)."""
    virtual_local_rank: bool
    """torchrun's ``--virtual-local-rank``: every worker gets ``LOCAL_RANK=0`` and sees only
    its own GPU (``CUDA_VISIBLE_DEVICES``: the local rank's entry of the launcher's list,
    else the local rank itself)."""
    spare_workers: int
    """Extra workers this node keeps ready for an in-process restart (``--spare-workers``):
    each runs the script's set-up and waits in its ``@rallypoint.restartable`` function;
    a rank that needs a new process takes one instead of running the set-up again."""
    numa_binding: str | None
    """torchrun's ``--numa-binding``: ``node``, ``socket``, ``exclusive`` or
    ``core-complex`` binds each worker to CPUs near GPU ``LOCAL_RANK`` (``_numa``)."""

    def __post_init__(self) -> None:
        if self.spare_workers and self.virtual_local_rank:
            raise ValueError(
                "spare_workers cannot be combined with virtual_local_rank: a spare's set-up "
                "runs before it knows which GPU (CUDA_VISIBLE_DEVICES) its rank will have"
            )
        visible = self.env.get(_CUDA_DEVICES, os.environ.get(_CUDA_DEVICES))
        if self.virtual_local_rank:
            visible_gpus(visible, self.nproc)
        if self.numa_binding is not None:
            check_numa_binding(self.numa_binding, self.nproc, visible)


_CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_gpus(parent: str | None, nproc: int) -> list[str]:
    """Each local rank's ``CUDA_VISIBLE_DEVICES`` under ``virtual_local_rank`` (torch's
    rule): its entry of the launcher's comma-separated list, else the local rank itself;
    ``ValueError`` if the list is shorter than ``nproc``."""
    if parent is None:
        return [str(local_rank) for local_rank in range(nproc)]
    gpus = [gpu.strip() for gpu in parent.split(",")]
    if len(gpus) < nproc:
        raise ValueError(
            f"virtual_local_rank: {nproc} workers per node, but CUDA_VISIBLE_DEVICES="
            f"{parent!r} lists {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} (one per "
            "worker is needed)"
        )
    return gpus[:nproc]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputOptions:
    """Where the workers' stdout and stderr go."""

    log_dir: str | None
    """Per-rank ``stdout.log``/``stderr.log``/``error.json`` under
    ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/`` (torchrun's layout)."""
    redirects: StdSpec
    """Send these streams only to the log files (torchrun's ``-r``)."""
    tee: StdSpec
    """Send these streams to the log files and the console (torchrun's ``-t``)."""
    local_ranks_filter: frozenset[int] | None
    """Show only these local ranks on the console (files keep everything)."""
    prefix: str | None
    """Console line prefix template; ``None`` or ``""`` turns prefixes off."""
    duplicate_stdout_filters: tuple[str, ...]
    """Lines of tee'd stdout streams that contain any of these strings are also copied to
    ``attempt_N/filtered_stdout.log`` (torchrun's ``--duplicate-stdout-filters``; as there,
    an empty string matches every line)."""
    duplicate_stderr_filters: tuple[str, ...]
    """The same for stderr, to ``attempt_N/filtered_stderr.log``."""

    def std_mask(self, which: Literal["redirects", "tee"], local_rank: int) -> int:
        """The stream mask (1 stdout, 2 stderr) that ``redirects``/``tee`` give ``local_rank``."""
        spec = self.redirects if which == "redirects" else self.tee
        return spec if isinstance(spec, int) else spec.get(local_rank, _NONE)

    def wants_files(self, nproc: int) -> bool:
        """Whether some stream of some local rank goes to a log file."""
        return (
            self.log_dir is not None
            or bool(self.duplicate_stdout_filters or self.duplicate_stderr_filters)
            or any(
                self.std_mask(which, lr) for which in ("redirects", "tee") for lr in range(nproc)
            )
        )


MAX_MONITOR_INTERVAL = 3600.0
"""The longest ``monitor_interval``: the supervisor's wait, which the OS takes in
milliseconds as a C int (24.8 days at most), and an hour is long past useful already."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopOptions:
    """How the supervisor watches and stops its workers."""

    monitor_interval: timedelta
    """Upper bound on the supervisor's wait; exits are noticed immediately regardless (at
    most :data:`MAX_MONITOR_INTERVAL`)."""
    shutdown_timeout: timedelta
    """Grace period between SIGTERM and SIGKILL when stopping workers."""
    timeout: timedelta | None
    """Stop the job and raise ``LaunchTimeoutError`` after this long (``None``: no limit)."""
    signals_to_handle: tuple[str, ...]
    """Signals the launcher forwards to its workers."""
    restart_grace: timedelta
    """How long a worker of ``@rallypoint.restartable`` has to leave its function when
    the job restarts in process; one that does not is replaced."""

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        return tuple(int(getattr(signal, name)) for name in self.signals_to_handle)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldOptions:
    """The world of a single-node launch: its ranks and the store its workers meet in."""

    master_addr: str
    master_port: int | None
    """Store port; ``None`` or 0 picks a free one, a busy explicit port is an error."""
    rank_offset: int
    """Global rank of local rank 0; several launches can share one world (see docs)."""
    world_size: int | None
    """Total world size when launches share a world; ``None``: ``nproc``."""
    run_id: str | None
    """``TORCHELASTIC_RUN_ID``; a random id when ``None``."""

    def __post_init__(self) -> None:
        if self.rank_offset > 0 and not self.master_port:
            raise ValueError(
                "rank_offset > 0 joins a world hosted by another launch: pass the same explicit "
                "master_addr and master_port as the launch with rank_offset=0"
            )
