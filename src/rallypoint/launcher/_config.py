"""``LaunchConfig``: every option of ``rallypoint.launch`` and ``rallypoint run``.

The CLI parses its flags into this dataclass, so the API and the CLI validate the same way:
bad values raise ``ValueError``/``TypeError`` with a message that says what to change.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

__all__ = ["DEFAULT_PREFIX", "LaunchConfig", "parse_std_spec"]

DEFAULT_PREFIX = "[rank${rank}]: "
"""Default console line prefix; ``${rank}``, ``${local_rank}`` and ``${role_name}`` expand."""

_NONE, _OUT, _ERR, _ALL = 0, 1, 2, 3
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def parse_std_spec(value: str | int | Mapping[int, int], what: str) -> dict[int, int] | int:
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


def _seconds(value: timedelta | float | int | None, what: str, *, allow_zero: bool) -> None:
    if value is None:
        return
    if not isinstance(value, timedelta):
        raise TypeError(f"{what} must be a datetime.timedelta, got {type(value).__name__}")
    secs = value.total_seconds()
    if secs < 0 or (secs == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Options of a launch; the CLI flag with the same name (``-`` for ``_``) sets each."""

    nproc: int = 1
    """Workers on this node (``--nproc-per-node``)."""
    nnodes: str = "1:1"
    """Nodes, ``N`` or ``MIN:MAX``; more than one runs the elastic agent (a rendezvous)."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend of a multi-node job: ``c10d``, ``etcd``, ``file`` or ``static``."""
    rdzv_endpoint: str = ""
    """``HOST:PORT`` of the rendezvous store (a path for ``file``)."""
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    """Rendezvous options (``join_timeout``, ``last_call_timeout``, ``keep_alive_interval``...)."""
    node_rank: int | None = None
    """This node's rank with the ``static`` backend."""
    hang_timeout: timedelta | None = None
    """No progress from any worker for this long is a hang (``None``: not watched)."""
    on_hang: Literal["restart", "fail"] = "restart"
    """What a hang does: restart the workers (counts as a restart) or fail the job."""
    events: str | os.PathLike[str] | None = None
    """Append the job's events (JSON lines) to this file; ``rallypoint report`` draws them."""
    max_restarts: int = 0
    """Restart the whole local group this many times after a failure."""
    monitor_interval: timedelta = timedelta(seconds=0.1)
    """Upper bound on the supervisor's wait; exits are noticed immediately regardless."""
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """Store port; ``None`` or 0 picks a free one, a busy explicit port is an error."""
    rank_offset: int = 0
    """Global rank of local rank 0; several launches can share one world (see docs)."""
    world_size: int | None = None
    """Total world size when launches share a world; defaults to ``nproc``."""
    run_id: str | None = None
    """``TORCHELASTIC_RUN_ID``; a random id when ``None``."""
    role: str = "default"
    start_method: Literal["fork", "spawn"] = "fork"
    """``fork`` from the warm process, or ``spawn`` a fresh interpreter per worker."""
    preload: tuple[str, ...] = ()
    """Modules the warm process imports before forking (``--preload a,b``)."""
    log_dir: str | os.PathLike[str] | None = None
    """Per-rank ``stdout.log``/``stderr.log``/``error.json`` under
    ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/`` (torchrun's layout)."""
    redirects: str | int | Mapping[int, int] = 0
    """Send these streams only to the log files (torchrun's ``-r``)."""
    tee: str | int | Mapping[int, int] = 0
    """Send these streams to the log files and the console (torchrun's ``-t``)."""
    local_ranks_filter: frozenset[int] | None = None
    """Show only these local ranks on the console (files keep everything)."""
    prefix: str | None = DEFAULT_PREFIX
    """Console line prefix template; ``None`` or ``""`` turns prefixes off."""
    shutdown_timeout: timedelta = timedelta(seconds=30)
    """Grace period between SIGTERM and SIGKILL when stopping workers."""
    timeout: timedelta | None = None
    """Stop the job and raise ``LaunchTimeoutError`` after this long (``None``: no limit)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""
    cwd: str | os.PathLike[str] | None = None
    """Working directory of the workers (default: the launcher's)."""
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    """Signals the launcher forwards to its workers."""
    parallel: object | None = None
    """A ``rallypoint.distributed`` parallel layout: ``launch`` then wraps ``fn`` with
    ``rallypoint.distributed.parallel_worker(fn, parallel)``."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int):
            raise TypeError(f"nproc must be an int, got {type(self.nproc).__name__}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        self.nnodes = str(self.nnodes)
        parts = self.nnodes.split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        lo, hi = int(parts[0]), int(parts[-1])
        if not 0 < lo <= hi:
            raise ValueError(f"nnodes must satisfy 0 < MIN <= MAX, got {self.nnodes!r}")
        if hi > 1 and (self.rank_offset or self.world_size is not None):
            raise ValueError(
                "rank_offset/world_size share a world between launches on one node; a "
                "multi-node job (nnodes > 1) gets its ranks from the rendezvous instead"
            )
        if self.rdzv_backend not in ("c10d", "etcd", "etcd-v3", "file", "static"):
            raise ValueError(
                f"rdzv_backend must be one of c10d, etcd, file, static, got {self.rdzv_backend!r}"
            )
        if hi > 1 and self.rdzv_backend != "file" and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes={self.nnodes!r} needs a rendezvous endpoint: pass --rdzv-endpoint "
                "HOST:PORT (rdzv_endpoint=), the same on every node"
            )
        if not isinstance(self.rdzv_conf, Mapping):
            raise TypeError("rdzv_conf must be a mapping of option names to values")
        if self.node_rank is not None and (
            isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int)
        ):
            raise TypeError(f"node_rank must be an int, got {type(self.node_rank).__name__}")
        if self.rdzv_backend == "static" and hi > 1:
            if self.node_rank is None or not 0 <= self.node_rank < hi:
                raise ValueError(
                    f"the static rendezvous needs --node-rank in [0, {hi}), got {self.node_rank}"
                )
            if lo != hi:
                raise ValueError(f"the static rendezvous needs a fixed --nnodes, got {lo}:{hi}")
        _seconds(self.hang_timeout, "hang_timeout", allow_zero=False)
        if self.on_hang not in ("restart", "fail"):
            raise ValueError(f"on_hang must be 'restart' or 'fail', got {self.on_hang!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(f"max_restarts must be an int, got {type(self.max_restarts).__name__}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        _seconds(self.monitor_interval, "monitor_interval", allow_zero=False)
        _seconds(self.shutdown_timeout, "shutdown_timeout", allow_zero=True)
        _seconds(self.timeout, "timeout", allow_zero=False)
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a non-empty host name, got {self.master_addr!r}")
        if self.master_port is not None:
            if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
                raise TypeError(
                    f"master_port must be an int, got {type(self.master_port).__name__}"
                )
            if not 0 <= self.master_port < 65536:
                raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int):
            raise TypeError(f"rank_offset must be an int, got {type(self.rank_offset).__name__}")
        if self.rank_offset < 0:
            raise ValueError(f"rank_offset must be >= 0, got {self.rank_offset}")
        world = self.total_world_size
        if self.rank_offset + self.nproc > world:
            raise ValueError(
                f"rank_offset ({self.rank_offset}) + nproc ({self.nproc}) exceeds "
                f"world_size ({world}); raise world_size or lower rank_offset"
            )
        if self.rank_offset > 0 and not self.master_port:
            raise ValueError(
                "rank_offset > 0 joins a world hosted by another launch: pass the same explicit "
                "master_addr and master_port as the launch with rank_offset=0"
            )
        if self.max_restarts and world != self.nproc:
            raise ValueError(
                "max_restarts needs the whole world in one launch (world_size == nproc); "
                "for restarts across nodes use nnodes with a rendezvous"
            )
        if self.start_method not in ("fork", "spawn"):
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {self.start_method!r}")
        if isinstance(self.preload, str):
            self.preload = tuple(m for m in self.preload.split(",") if m)
        self.preload = tuple(self.preload)
        for mod in self.preload:
            if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", mod):
                raise ValueError(f"preload: {mod!r} is not a module name")
        parse_std_spec(self.redirects, "redirects")
        parse_std_spec(self.tee, "tee")
        if self.local_ranks_filter is not None:
            ranks = frozenset(self.local_ranks_filter)
            if not ranks or not all(isinstance(r, int) and r >= 0 for r in ranks):
                raise ValueError(
                    "local_ranks_filter must be a non-empty set of local ranks such as {0, 1}"
                )
            self.local_ranks_filter = ranks
        if self.prefix is not None and not isinstance(self.prefix, str):
            raise TypeError(f"prefix must be a str or None, got {type(self.prefix).__name__}")
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise TypeError("env must be a mapping of str to str")
        if self.cwd is not None and not Path(self.cwd).is_dir():
            raise ValueError(f"cwd {os.fspath(self.cwd)!r} is not a directory")
        for name in self.signals_to_handle.split(","):
            if name.strip() and name.strip() not in _SIGNALS:
                raise ValueError(f"signals_to_handle: {name!r} is not one of {', '.join(_SIGNALS)}")
        if not isinstance(self.role, str) or not self.role:
            raise ValueError("role must be a non-empty string")

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def multi_node(self) -> bool:
        """Whether this launch runs the elastic agent (a rendezvous of several nodes)."""
        return self.max_nodes > 1

    @property
    def total_world_size(self) -> int:
        """The job's world size: ``world_size`` if given, else ``nproc``."""
        if self.world_size is None:
            return self.nproc
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {type(self.world_size).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        return self.world_size

    def std_mask(self, which: Literal["redirects", "tee"], local_rank: int) -> int:
        """The stream mask (1 stdout, 2 stderr) that ``redirects``/``tee`` give ``local_rank``."""
        spec = parse_std_spec(self.redirects if which == "redirects" else self.tee, which)
        return spec if isinstance(spec, int) else spec.get(local_rank, _NONE)
