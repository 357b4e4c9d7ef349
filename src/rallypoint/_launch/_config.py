"""``LaunchConfig``: every option of ``rallypoint.launch`` and ``rallypoint run``, each
declared once, as a field whose metadata carries its default, its check, its flag
(spellings, ``PET_`` variable, help) and the option group that stores it (``_option``).

Users (and the CLI) pass flat options, ``LaunchConfig(nproc=4, nnodes="2:4", ...)``; the
config stores them parsed, in one small validated group per concern (``workers``,
``output``, ``stop``, ``world``, ``watch``, ``restarts``, ``rendezvous``, ``health``), each
defined by the part that reads it, and every flat option reads back parsed
(``config.preload``: a tuple); the groups take the checked values as they are. Bad values
raise ``ValueError``/``TypeError`` naming the flat option. The options: docs/launcher.md.
"""

# option() makes a dataclass field, as dataclasses.field() does:
# ruff: noqa: RUF009
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Self, TypeAlias

from rallypoint._core.checks import MAX_SECONDS
from rallypoint._elastic._options import HealthOptions, RendezvousOptions, RestartOptions
from rallypoint._launch import _values as values
from rallypoint._launch._option import Option, declared, flag, option, store
from rallypoint._supervise._numa import NUMA_MODES
from rallypoint._supervise._options import (
    DEFAULT_PREFIX,
    MAX_MONITOR_INTERVAL,
    OutputOptions,
    StopOptions,
    WorkerOptions,
    WorldOptions,
)
from rallypoint._watch._flight._recorder import DEFAULT_BUFFER
from rallypoint._watch._observer import SETUP_FACTOR, SETUP_MINIMUM, WatchOptions
from rallypoint._watch._stragglers._pace import DEFAULT_THRESHOLD, WINDOW_S

__all__ = ["DEFAULT_PREFIX", "OPTION_NAMES", "LaunchConfig", "LaunchOptions"]

LaunchOptions: TypeAlias = dict[str, Any]
"""The flat options of :func:`launch` and :class:`LaunchConfig`: its fields, by name."""

_GROUPS: dict[str, Callable[..., Any]] = {
    "workers": WorkerOptions,
    "rendezvous": RendezvousOptions,
    "health": HealthOptions,
    "watch": WatchOptions,
    "restarts": RestartOptions,
    "stop": StopOptions,
    "world": WorldOptions,
    "output": OutputOptions,
}
"""Each group's record, in the order they are made (the first bad option's error wins)."""


_NODES = "nodes and rendezvous"
_STDIO_HELP = "streams to {}: 0-3 or RANK:MASK,..."
_FILTERS_HELP = (
    "copy the tee'd {0} lines that contain one of these comma-separated strings (',,' for a "
    "comma) to LOG_DIR/RUN_ID/attempt_N/filtered_{0}.log"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """Options of a launch; the CLI flag with the same name (``-`` for ``_``) sets each.

    ``LaunchConfig(**options)`` takes the flat options below (each left out takes its
    declared default) and stores them checked in the groups (see the module docstring).
    """

    # ------------------------------------------------------------ nodes and rendezvous
    nnodes: str | int = option(
        "rendezvous",
        default="1:1",
        attr=("min_nodes", "max_nodes"),
        parse=values.as_nnodes,
        read=lambda rendezvous: rendezvous.nnodes,
        flag=flag(
            "--nnodes", section=_NODES, help="nodes: N or MIN:MAX (elastic between MIN and MAX)"
        ),
    )
    """``N`` or ``MIN:MAX``."""
    rdzv_backend: str = option(
        "rendezvous",
        default="c10d",
        attr="backend",
        parse=values.as_backend,
        flag=flag(
            "--rdzv-backend",
            "--rdzv_backend",
            default="static",  # torchrun's
            value=values.rdzv_backend,
            help="rendezvous backend of a multi-node job: c10d, etcd, etcd-v3, file, static, "
            "or an installed plugin's",
        ),
    )
    rdzv_endpoint: str = option(
        "rendezvous",
        default="",
        attr="endpoint",
        parse=values.as_endpoint,
        flag=flag("--rdzv-endpoint", "--rdzv_endpoint", help="HOST:PORT of the store"),
    )
    run_id: str | None = option(
        "world",
        parse=values.as_run_id,
        flag=flag(
            "--rdzv-id", "--rdzv_id", value=values.run_id, help="job id (TORCHELASTIC_RUN_ID)"
        ),
    )
    rdzv_conf: Mapping[str, str] = option(
        "rendezvous",
        default={},
        attr="conf",
        parse=values.as_conf,
        flag=flag(
            "--rdzv-conf",
            "--rdzv_conf",
            value=values.key_values,
            help="rendezvous options: k=v,k=v",
        ),
    )
    max_restarts: int = option(
        "restarts",
        default=0,
        parse=values.count(0),
        flag=flag("--max-restarts", "--max_restarts", type=int, help="group restarts"),
    )
    max_same_failure: int | None = option(
        "restarts",
        default=3,
        parse=values.count(1, none=True),
        flag=flag(
            "--max-same-failure",
            "--max_same_failure",
            value=values.count_or_off,
            help="end the job when the same root cause failed N attempts in a row, or off "
            "(default {default})",
        ),
    )
    hot_spare: bool = option(
        "restarts",
        default=False,
        flag=flag(
            "--hot-spare",
            "--hot_spare",
            switch=True,
            help="while this node waits as a spare, start its workers: they run the script's "
            "set-up and wait in their @rallypoint.restartable function for ranks",
        ),
    )
    spare_workers: int = option(
        "workers",
        default=0,
        parse=values.count(0),
        flag=flag(
            "--spare-workers",
            "--spare_workers",
            type=int,
            help="keep N extra workers that ran the script's set-up ready to take a replaced "
            "rank's place in an in-process restart (@rallypoint.restartable)",
        ),
    )
    burn_in: bool = option(
        "restarts",
        default=False,
        flag=flag(
            "--burn-in",
            "--burn_in",
            switch=True,
            help="after each round forms, time the nodes' links and exclude a node much "
            "slower than the median (3 nodes or more)",
        ),
    )
    max_node_failures: int | None = option(
        "restarts",
        default=2,
        parse=values.count(1, none=True),
        flag=flag(
            "--max-node-failures",
            "--max_node_failures",
            value=values.count_or_off,
            help="exclude a node that was the root cause of K failures in a row while MIN "
            "nodes remain, or off (default {default})",
        ),
    )
    monitor_interval: timedelta = option(
        "stop",
        default=timedelta(seconds=0.1),
        flag=flag(
            "--monitor-interval", "--monitor_interval", seconds=MAX_MONITOR_INTERVAL, help="seconds"
        ),
    )
    node_rank: int | None = option(
        "rendezvous",
        parse=values.count(none=True),
        flag=flag(  # torchrun's default
            "--node-rank", "--node_rank", default=0, type=int, help="node rank (static backend)"
        ),
    )
    local_addr: str | None = option(
        "rendezvous",
        parse=values.as_local_addr,
        flag=flag(
            "--local-addr",
            "--local_addr",
            help="this node's address for the others (its workers' MASTER_ADDR if it hosts "
            "the store)",
        ),
    )
    # ------------------------------------------------------------------------ workers
    nproc: int = option(
        "workers",
        default=1,
        parse=values.count(1),
        flag=flag(
            "--nproc-per-node",
            "--nproc_per_node",
            section="workers",
            value=values.parse_nproc,
            help="workers: int, cpu, gpu, auto",
        ),
    )
    start_method: Literal["fork", "spawn"] = option(
        "workers",
        default="fork",
        parse=values.one_of("fork", "spawn"),
        flag=flag(
            "--start-method",
            "--start_method",
            choices=("fork", "spawn", "forkserver"),
            value=values.fork_or_spawn,
            help="fork from the warm process (default) or spawn fresh interpreters",
        ),
    )
    role: str = option(
        "workers",
        default="default",
        parse=values.as_role,
        flag=flag("--role", help="worker role (ROLE_NAME)"),
    )
    signals_to_handle: str = option(
        "stop",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        parse=values.as_signals,
        read=lambda stop: ",".join(stop.signals_to_handle),
        flag=flag(
            "--signals-to-handle", "--signals_to_handle", help="signals forwarded to the workers"
        ),
    )
    """The signals forwarded to the workers, as on the command line."""
    shutdown_timeout: timedelta = option(
        "stop",
        default=timedelta(seconds=30),
        flag=flag(
            "--shutdown-timeout",
            "--shutdown_timeout",
            default=None,  # torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else this default (_cli)
            seconds=MAX_SECONDS,
            zero=True,
            help="seconds",
        ),
    )
    restart_grace: timedelta = option(
        "stop",
        default=timedelta(seconds=10),
        flag=flag(
            "--restart-grace",
            "--restart_grace",
            seconds=MAX_SECONDS,
            help="seconds a worker of a @rallypoint.restartable function has to leave it when "
            "the job restarts in process; one that does not is replaced (default {default})",
        ),
    )
    virtual_local_rank: bool = option(
        "workers",
        default=False,
        flag=flag(
            "--virtual-local-rank",
            "--virtual_local_rank",
            switch=True,
            help="LOCAL_RANK=0 for every worker, each seeing only its own GPU "
            "(CUDA_VISIBLE_DEVICES)",
        ),
    )
    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = option(
        "workers",
        parse=values.as_numa_mode,
        flag=flag(
            "--numa-binding",
            "--numa_binding",
            choices=NUMA_MODES,
            value=values.or_none,
            help="bind each worker to the CPUs near GPU LOCAL_RANK (torch's modes; needs a GPU)",
        ),
    )
    # ------------------------------------------------------------------------- output
    log_dir: str | os.PathLike[str] | None = option(
        "output",
        parse=values.as_path,
        flag=flag("--log-dir", "--log_dir", section="output", help="per-rank log files go here"),
    )
    redirects: str | int | Mapping[int, int] = option(
        "output",
        default=0,
        parse=values.as_std_spec,
        flag=flag("-r", "--redirects", value=values.text, help=_STDIO_HELP.format("files only")),
    )
    tee: str | int | Mapping[int, int] = option(
        "output",
        default=0,
        parse=values.as_std_spec,
        flag=flag("-t", "--tee", value=values.text, help=_STDIO_HELP.format("files and console")),
    )
    local_ranks_filter: Iterable[int] | None = option(
        "output",
        parse=values.as_ranks,
        flag=flag(
            "--local-ranks-filter",
            "--local_ranks_filter",
            value=values.local_ranks,
            help="show only these local ranks on the console, e.g. 0,1",
        ),
    )
    duplicate_stdout_filters: Iterable[str] = option(
        "output",
        default=(),
        parse=values.as_filters,
        flag=flag(
            "--duplicate-stdout-filters",
            "--duplicate_stdout_filters",
            value=values.filters,
            help=_FILTERS_HELP.format("stdout"),
        ),
    )
    duplicate_stderr_filters: Iterable[str] = option(
        "output",
        default=(),
        parse=values.as_filters,
        flag=flag(
            "--duplicate-stderr-filters",
            "--duplicate_stderr_filters",
            value=values.filters,
            help=_FILTERS_HELP.format("stderr"),
        ),
    )
    # -------------------------------------------------------------- single-node store
    master_addr: str = option(
        "world",
        default="127.0.0.1",
        parse=values.as_host,
        flag=flag(
            "--master-addr", "--master_addr", section="single-node store", help="store address"
        ),
    )
    master_port: int | None = option(
        "world",
        parse=values.count(0, maximum=65535, none=True),
        flag=flag("--master-port", "--master_port", type=int, help="store port (free if unset)"),
    )
    # ---------------------------------------------------------------------- rallypoint
    preload: tuple[str, ...] | str = option(
        "workers",
        default="",
        parse=values.as_modules,
        flag=flag(
            "--preload",
            section="rallypoint",
            value=values.module_names,
            help="modules the warm process imports: a,b",
        ),
    )
    prefix: str | None = option(
        "output",
        default=DEFAULT_PREFIX,
        parse=values.as_text,
        flag=flag(
            "--prefix",
            default=lambda: os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", DEFAULT_PREFIX),
            help="line prefix template (${rank}, ${local_rank}, ${role_name})",
        ),
    )
    timeout: timedelta | None = option(
        "stop", flag=flag("--timeout", seconds=MAX_SECONDS, help="stop the job after SECONDS")
    )
    hang_timeout: timedelta | None = option(
        "watch",
        flag=flag(
            "--hang-timeout",
            "--hang_timeout",
            seconds=MAX_SECONDS,
            help="no rallypoint.progress() from any worker for SECONDS is a hang (off by default)",
        ),
    )
    setup_timeout: timedelta | None = option(
        "watch",
        flag=flag(
            "--setup-timeout",
            "--setup_timeout",
            seconds=MAX_SECONDS,
            help="with --hang-timeout: while a worker has not called rallypoint.progress() yet "
            "in an attempt (its set-up), and once one finished (the others' wind-down), the "
            f"hang is no progress for SECONDS (default "
            f"{SETUP_FACTOR} times --hang-timeout, at least {SETUP_MINIMUM:g})",
        ),
    )
    on_hang: Literal["restart", "fail"] = option(
        "restarts",
        default="restart",
        parse=values.one_of("restart", "fail"),
        flag=flag(
            "--on-hang",
            "--on_hang",
            choices=("restart", "fail"),
            help="after printing the stacks of a hang: restart (counts as one) or fail",
        ),
    )
    events: str | os.PathLike[str] | None = option(
        "watch",
        parse=values.as_events,
        flag=flag("--events", help="append the job's events (JSON lines) to FILE"),
    )
    straggler_threshold: float | str | None = option(
        "watch",
        default=DEFAULT_THRESHOLD,
        parse=values.as_threshold,
        flag=flag(
            "--straggler-threshold",
            "--straggler_threshold",
            value=values.threshold,
            help="report a rank or node whose step time (between rallypoint.progress() calls) "
            "exceeds this many times the median of the others: a number > 1, or off "
            "(default {default})",
        ),
    )
    straggler_window: timedelta | float = option(
        "watch",
        default=timedelta(seconds=WINDOW_S),
        parse=values.as_window,
        flag=flag(
            "--straggler-window",
            "--straggler_window",
            seconds=MAX_SECONDS,
            help="seconds of recent steps a step time is averaged over (default {default})",
        ),
    )
    health_check: Sequence[str] | str = option(
        "health",
        default=(),
        attr="checks",
        parse=values.as_checks,
        flag=flag(
            "--health-check",
            "--health_check",
            repeat=True,
            value=values.health_checks,
            help="run CMD (a shell command, exit 0: healthy) or builtin:disk, builtin:gpu, "
            "builtin:store before this node joins a round; a failure keeps the node out "
            "(exit code 3); repeatable; PET_HEALTH_CHECK: one check per line",
        ),
    )
    health_check_timeout: timedelta | float = option(
        "health",
        default=timedelta(seconds=60),
        attr="timeout",
        parse=values.as_health_timeout,
        flag=flag(
            "--health-check-timeout",
            "--health_check_timeout",
            seconds=MAX_SECONDS,
            value=values.positive,
            help="seconds one health check may take before it is killed and fails "
            "(default {default})",
        ),
    )
    flight_recorder: int | str | None = option(
        "watch",
        default=DEFAULT_BUFFER,
        parse=values.as_buffer,
        flag=flag(
            "--flight-recorder",
            "--flight_recorder",
            value=values.buffer,
            help="collectives each worker's torch Flight Recorder keeps, used to name the rank "
            "and collective of a hang: a number, or off (default {default}; "
            "TORCH_FR_BUFFER_SIZE wins)",
        ),
    )
    # ------------------------------------------------------------ launch() and the API
    env: Mapping[str, str] = option("workers", default={}, parse=values.as_env)
    """Extra environment variables for the workers."""
    cwd: str | os.PathLike[str] | None = option("workers", parse=values.as_cwd)
    rank_offset: int = option("world", default=0, parse=values.count(0))
    world_size: int | None = option("world", parse=values.count(1, none=True))
    parallel: object | None = option(None)
    """A ``rallypoint.distributed`` parallel layout: ``launch`` then wraps ``fn`` with
    ``rallypoint.distributed.parallel_worker(fn, parallel)``."""

    # ------------------------------------------------------------------ the groups
    workers: WorkerOptions = field(init=False, repr=False, compare=False)
    rendezvous: RendezvousOptions = field(init=False, repr=False, compare=False)
    health: HealthOptions = field(init=False, repr=False, compare=False)
    watch: WatchOptions = field(init=False, repr=False, compare=False)
    restarts: RestartOptions = field(init=False, repr=False, compare=False)
    stop: StopOptions = field(init=False, repr=False, compare=False)
    world: WorldOptions = field(init=False, repr=False, compare=False)
    output: OutputOptions = field(init=False, repr=False, compare=False)

    def __new__(cls, **options: Any) -> Self:
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:  # as before it was a dataclass: not "LaunchConfig.__init__()"
            raise TypeError(f"LaunchConfig() got an unexpected keyword argument {unknown[0]!r}")
        return object.__new__(cls)

    def __post_init__(self) -> None:
        store(self, _DECLARED, _GROUPS)
        self._check_together()

    def _check_together(self) -> None:
        """The rules that span groups."""
        world, nproc = self.world, self.workers.nproc
        if self.rendezvous.multi_node and (world.rank_offset or world.world_size is not None):
            raise ValueError(
                "rank_offset/world_size share a world between launches on one node; a "
                "multi-node job (nnodes > 1) gets its ranks from the rendezvous instead"
            )
        total = self.total_world_size
        if world.rank_offset + nproc > total:
            raise ValueError(
                f"rank_offset ({world.rank_offset}) + nproc ({nproc}) exceeds "
                f"world_size ({total}); raise world_size or lower rank_offset"
            )
        if self.workers.spare_workers and not self.restarts.max_restarts:
            raise ValueError(
                "spare_workers needs max_restarts > 0: a spare worker takes a replaced "
                "rank's place in a restart (--max-restarts N)"
            )
        if self.restarts.max_restarts and total != nproc:
            raise ValueError(
                "max_restarts needs the whole world in one launch (world_size == nproc); "
                "for restarts across nodes use nnodes with a rendezvous"
            )

    @property
    def min_nodes(self) -> int:
        return self.rendezvous.min_nodes

    @property
    def max_nodes(self) -> int:
        return self.rendezvous.max_nodes

    @property
    def multi_node(self) -> bool:
        """Whether this launch runs the elastic coordinator (a rendezvous of several nodes)."""
        return self.rendezvous.multi_node

    @property
    def total_world_size(self) -> int:
        """The job's world size: ``world_size`` if given, else ``nproc``."""
        return self.world.world_size or self.workers.nproc

    @property
    def forks_workers_later(self) -> bool:
        """Whether workers can be forked after the first ones: restarts or spares."""
        return bool(self.restarts.max_restarts or self.workers.spare_workers)

    def std_mask(self, which: Literal["redirects", "tee"], local_rank: int) -> int:
        """The stream mask (1 stdout, 2 stderr) that ``redirects``/``tee`` give ``local_rank``."""
        return self.output.std_mask(which, local_rank)


_DECLARED: tuple[tuple[str, Option], ...] = tuple(declared(LaunchConfig))

OPTION_NAMES = frozenset(name for name, _ in _DECLARED)
"""Every flat option name: ``launch()``'s keywords."""
