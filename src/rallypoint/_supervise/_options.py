"""The option groups of one node's supervision, stored parsed and validated.

``LaunchConfig`` (``rallypoint.launcher``) is made of these groups and those of the other
parts; it turns the flat options users pass (``nproc=``, ``preload="a,b"``,
``redirects="0:1"``...) into them. Each group checks its own fields in ``__post_init__``
(``TypeError``/``ValueError`` naming the flat option) and is frozen.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, TypeAlias

from rallypoint._core.checks import MAX_SECONDS, check_int, check_seconds
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
_MODULE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


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


def _is_local_rank(value: object) -> bool:
    try:
        check_int(value, "local rank", minimum=0)
    except (TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """What runs on this node: how many workers, how they start, where, with what."""

    nproc: int = 1
    """Workers on this node (``--nproc-per-node``)."""
    role: str = "default"
    start_method: Literal["fork", "spawn"] = "fork"
    """``fork`` from the warm process, or ``spawn`` a fresh interpreter per worker."""
    preload: tuple[str, ...] = ()
    """Modules the warm process imports before forking (``--preload a,b``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""
    cwd: str | None = None
    """Working directory of the workers (default: the launcher's)."""
    virtual_local_rank: bool = False
    """torchrun's ``--virtual-local-rank``: every worker gets ``LOCAL_RANK=0`` and sees only
    its own GPU (``CUDA_VISIBLE_DEVICES``: the local rank's entry of the launcher's list,
    else the local rank itself)."""
    spare_workers: int = 0
    """Extra workers this node keeps ready for an in-process restart (``--spare-workers``):
    each runs the script's set-up and waits in its ``@rallypoint.restartable`` function;
    a rank that needs a new process takes one instead of running the set-up again."""
    numa_binding: str | None = None
    """torchrun's ``--numa-binding``: ``node``, ``socket``, ``exclusive`` or
    ``core-complex`` binds each worker to CPUs near GPU ``LOCAL_RANK`` (``_numa``)."""

    def __post_init__(self) -> None:
        check_int(self.nproc, "nproc", minimum=1)
        check_int(self.spare_workers, "spare_workers", minimum=0)
        if self.spare_workers and self.virtual_local_rank:
            raise ValueError(
                "spare_workers cannot be combined with virtual_local_rank: a spare's set-up "
                "runs before it knows which GPU (CUDA_VISIBLE_DEVICES) its rank will have"
            )
        if not isinstance(self.virtual_local_rank, bool):
            raise TypeError(
                f"virtual_local_rank must be True or False, got {self.virtual_local_rank!r}"
            )
        if not isinstance(self.role, str) or not self.role:
            raise ValueError("role must be a non-empty string")
        if self.start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {self.start_method!r}")
        for module in self.preload:
            if not isinstance(module, str) or not _MODULE.fullmatch(module):
                raise ValueError(f"preload: {module!r} is not a module name")
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise TypeError("env must be a mapping of str to str")
        if self.cwd is not None and not isinstance(self.cwd, str):
            raise TypeError(f"cwd must be a path or None, got {type(self.cwd).__name__}")
        if self.cwd is not None and not os.path.isdir(self.cwd):
            raise ValueError(f"cwd {self.cwd!r} is not a directory")
        visible = self.env.get(_CUDA_DEVICES, os.environ.get(_CUDA_DEVICES))
        if self.virtual_local_rank:
            visible_gpus(visible, self.nproc)
        if self.numa_binding is not None:  # torch's AffinityMode is a str enum
            mode = getattr(self.numa_binding, "value", self.numa_binding)
            object.__setattr__(self, "numa_binding", mode)
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

    log_dir: str | None = None
    """Per-rank ``stdout.log``/``stderr.log``/``error.json`` under
    ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/`` (torchrun's layout)."""
    redirects: StdSpec = 0
    """Send these streams only to the log files (torchrun's ``-r``)."""
    tee: StdSpec = 0
    """Send these streams to the log files and the console (torchrun's ``-t``)."""
    local_ranks_filter: frozenset[int] | None = None
    """Show only these local ranks on the console (files keep everything)."""
    prefix: str | None = DEFAULT_PREFIX
    """Console line prefix template; ``None`` or ``""`` turns prefixes off."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    """Lines of tee'd stdout streams that contain any of these strings are also copied to
    ``attempt_N/filtered_stdout.log`` (torchrun's ``--duplicate-stdout-filters``; as there,
    an empty string matches every line)."""
    duplicate_stderr_filters: tuple[str, ...] = ()
    """The same for stderr, to ``attempt_N/filtered_stderr.log``."""

    def __post_init__(self) -> None:
        for which in ("redirects", "tee"):
            parse_std_spec(getattr(self, which), which)
        for which in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            filters = getattr(self, which)
            if not isinstance(filters, tuple) or not all(isinstance(f, str) for f in filters):
                raise TypeError(f"{which} must be a list of strings, got {filters!r}")
        ranks = self.local_ranks_filter
        if ranks is not None and not (ranks and all(_is_local_rank(r) for r in ranks)):
            raise ValueError(
                "local_ranks_filter must be a non-empty set of local ranks such as {0, 1}"
            )
        if self.log_dir is not None and not isinstance(self.log_dir, str):
            raise TypeError(f"log_dir must be a path or None, got {type(self.log_dir).__name__}")
        if self.prefix is not None and not isinstance(self.prefix, str):
            raise TypeError(f"prefix must be a str or None, got {type(self.prefix).__name__}")

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

    monitor_interval: timedelta = timedelta(seconds=0.1)
    """Upper bound on the supervisor's wait; exits are noticed immediately regardless (at
    most :data:`MAX_MONITOR_INTERVAL`)."""
    shutdown_timeout: timedelta = timedelta(seconds=30)
    """Grace period between SIGTERM and SIGKILL when stopping workers."""
    timeout: timedelta | None = None
    """Stop the job and raise ``LaunchTimeoutError`` after this long (``None``: no limit)."""
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    """Signals the launcher forwards to its workers."""
    restart_grace: timedelta = timedelta(seconds=10)
    """How long a worker of ``@rallypoint.restartable`` has to leave its function when
    the job restarts in process; one that does not is replaced."""

    def __post_init__(self) -> None:
        check_seconds(self.monitor_interval, "monitor_interval", maximum=MAX_MONITOR_INTERVAL)
        check_seconds(
            self.shutdown_timeout, "shutdown_timeout", allow_zero=True, maximum=MAX_SECONDS
        )
        check_seconds(self.restart_grace, "restart_grace", maximum=MAX_SECONDS)
        check_seconds(self.timeout, "timeout", allow_none=True, maximum=MAX_SECONDS)
        for name in self.signals_to_handle:
            if name not in SIGNALS:
                raise ValueError(f"signals_to_handle: {name!r} is not one of {', '.join(SIGNALS)}")

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        return tuple(int(getattr(signal, name)) for name in self.signals_to_handle)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldOptions:
    """The world of a single-node launch: its ranks and the store its workers meet in."""

    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """Store port; ``None`` or 0 picks a free one, a busy explicit port is an error."""
    rank_offset: int = 0
    """Global rank of local rank 0; several launches can share one world (see docs)."""
    world_size: int | None = None
    """Total world size when launches share a world; defaults to ``nproc``."""
    run_id: str | None = None
    """``TORCHELASTIC_RUN_ID``; a random id when ``None``."""

    def __post_init__(self) -> None:
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a non-empty host name, got {self.master_addr!r}")
        check_int(self.master_port, "master_port", minimum=0, maximum=65535, allow_none=True)
        check_int(self.rank_offset, "rank_offset", minimum=0)
        check_int(self.world_size, "world_size", minimum=1, allow_none=True)
        if self.rank_offset > 0 and not self.master_port:
            raise ValueError(
                "rank_offset > 0 joins a world hosted by another launch: pass the same explicit "
                "master_addr and master_port as the launch with rank_offset=0"
            )
        if self.run_id is not None and not isinstance(self.run_id, str):
            raise TypeError(f"run_id must be a str or None, got {type(self.run_id).__name__}")
        if self.run_id is not None and ("/" in self.run_id or "\0" in self.run_id):
            raise ValueError(
                f"run_id {self.run_id!r} must not contain '/' or NUL: it names the job's log "
                "and snapshot directories (use letters, digits, '-', '_' and '.')"
            )
