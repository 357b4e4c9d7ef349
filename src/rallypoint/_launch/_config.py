"""``LaunchConfig``: every option of ``rallypoint.launch`` and ``rallypoint run``.

Users (and the CLI) pass flat options, ``LaunchConfig(nproc=4, nnodes="2:4", ...)``; the
config stores them parsed, in one small validated group per concern (``workers``,
``output``, ``stop``, ``world``, ``watch``, ``restarts``, ``rendezvous``, ``health``), each
defined by the part that reads it (supervise, observe, elastic). Every flat option also
reads back as an attribute (``config.nproc``). Bad values raise ``ValueError``/``TypeError``
with a message that names the flat option. The options themselves: docs/launcher.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Literal, TypedDict, TypeVar, Unpack, overload

from rallypoint._core.checks import MAX_SECONDS, to_timedelta
from rallypoint._elastic._options import (
    HealthOptions,
    RendezvousOptions,
    RestartOptions,
    parse_nnodes,
)
from rallypoint._supervise._options import (
    DEFAULT_PREFIX,
    OutputOptions,
    StdSpec,
    StopOptions,
    WorkerOptions,
    WorldOptions,
    parse_std_spec,
)
from rallypoint._watch._observer import WatchOptions

__all__ = ["DEFAULT_PREFIX", "OPTION_NAMES", "LaunchConfig", "LaunchOptions"]

_T = TypeVar("_T")


class LaunchOptions(TypedDict, total=False):
    """The flat options of :func:`launch` and :class:`LaunchConfig` (see ``docs/launcher.md``)."""

    nproc: int
    nnodes: str | int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_conf: Mapping[str, str]
    node_rank: int | None
    local_addr: str | None
    health_check: Sequence[str] | str
    health_check_timeout: timedelta | float
    hang_timeout: timedelta | None
    on_hang: Literal["restart", "fail"]
    events: str | os.PathLike[str] | None
    straggler_threshold: float | str | None
    straggler_window: timedelta | float
    flight_recorder: int | str | None
    max_restarts: int
    max_same_failure: int | None
    max_node_failures: int | None
    burn_in: bool
    hot_spare: bool
    spare_workers: int
    monitor_interval: timedelta
    master_addr: str
    master_port: int | None
    rank_offset: int
    world_size: int | None
    run_id: str | None
    role: str
    start_method: Literal["fork", "spawn"]
    preload: tuple[str, ...] | str
    log_dir: str | os.PathLike[str] | None
    redirects: str | int | Mapping[int, int]
    tee: str | int | Mapping[int, int]
    local_ranks_filter: Iterable[int] | None
    prefix: str | None
    duplicate_stdout_filters: Iterable[str]
    duplicate_stderr_filters: Iterable[str]
    shutdown_timeout: timedelta
    restart_grace: timedelta
    timeout: timedelta | None
    env: Mapping[str, str]
    cwd: str | os.PathLike[str] | None
    virtual_local_rank: bool
    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None
    signals_to_handle: str
    parallel: object | None


OPTION_NAMES = frozenset(LaunchOptions.__optional_keys__)
"""Every flat option name."""


class _Flat(Generic[_T]):
    """A flat option read back from its group: ``config.nproc`` is ``config.workers.nproc``."""

    __slots__ = ("attr", "group")

    def __init__(self, group: str, attr: str = "") -> None:
        self.group = group
        self.attr = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = self.attr or name

    @overload
    def __get__(self, obj: None, owner: type) -> _Flat[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _T: ...
    def __get__(self, obj: object | None, owner: type) -> _Flat[_T] | _T:
        if obj is None:
            return self
        value: _T = getattr(getattr(obj, self.group), self.attr)
        return value


def _pick(options: Mapping[str, Any], *names: str) -> dict[str, Any]:
    return {name: options[name] for name in names if name in options}


def _path(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, str | os.PathLike) else value


def _workers(o: Mapping[str, Any]) -> WorkerOptions:
    kw = _pick(
        o,
        "nproc",
        "role",
        "start_method",
        "preload",
        "env",
        "cwd",
        "virtual_local_rank",
        "numa_binding",
        "spare_workers",
    )
    if "preload" in kw:
        preload = kw["preload"]
        kw["preload"] = tuple(
            m for m in (preload.split(",") if isinstance(preload, str) else preload) if m
        )
    if "cwd" in kw:
        kw["cwd"] = _path(kw["cwd"])
    return WorkerOptions(**kw)


def _output(o: Mapping[str, Any]) -> OutputOptions:
    kw = _pick(
        o,
        "log_dir",
        "redirects",
        "tee",
        "local_ranks_filter",
        "prefix",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
    )
    for which in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        if isinstance(kw.get(which), list | tuple):  # torch's LaunchConfig takes a list
            kw[which] = tuple(kw[which])
    for which in ("redirects", "tee"):
        if which in kw:
            kw[which] = parse_std_spec(kw[which], which)
    if kw.get("local_ranks_filter") is not None:
        kw["local_ranks_filter"] = frozenset(kw["local_ranks_filter"])
    if "log_dir" in kw:
        kw["log_dir"] = _path(kw["log_dir"])
    return OutputOptions(**kw)


def _stop(o: Mapping[str, Any]) -> StopOptions:
    kw = _pick(
        o, "monitor_interval", "shutdown_timeout", "timeout", "signals_to_handle", "restart_grace"
    )
    if "signals_to_handle" in kw:
        names = str(kw["signals_to_handle"]).split(",")
        kw["signals_to_handle"] = tuple(n.strip() for n in names if n.strip())
    return StopOptions(**kw)


def _world(o: Mapping[str, Any]) -> WorldOptions:
    return WorldOptions(
        **_pick(o, "master_addr", "master_port", "rank_offset", "world_size", "run_id")
    )


def _watch(o: Mapping[str, Any]) -> WatchOptions:
    kw = _pick(
        o, "hang_timeout", "events", "straggler_threshold", "straggler_window", "flight_recorder"
    )
    if "events" in kw:
        kw["events"] = _path(kw["events"])
    return WatchOptions(**kw)


def _rendezvous(o: Mapping[str, Any]) -> RendezvousOptions:
    kw = _pick(o, "node_rank", "local_addr")
    renamed = {"rdzv_backend": "backend", "rdzv_endpoint": "endpoint", "rdzv_conf": "conf"}
    kw.update({field: o[flat] for flat, field in renamed.items() if flat in o})
    if "nnodes" in o:
        kw["min_nodes"], kw["max_nodes"] = parse_nnodes(o["nnodes"])
    return RendezvousOptions(**kw)


def _health(o: Mapping[str, Any]) -> HealthOptions:
    kw: dict[str, Any] = {}
    if "health_check" in o:
        checks = o["health_check"]
        kw["checks"] = (checks,) if isinstance(checks, str) else tuple(checks)
    if "health_check_timeout" in o:
        value = o["health_check_timeout"]
        if isinstance(value, int | float) and not isinstance(value, bool):  # seconds
            value = to_timedelta(value, "health_check_timeout", maximum=MAX_SECONDS)
        kw["timeout"] = value
    return HealthOptions(**kw)


@dataclass(frozen=True, slots=True, init=False)
class LaunchConfig:
    """Options of a launch; the CLI flag with the same name (``-`` for ``_``) sets each.

    ``LaunchConfig(**options)`` takes the flat options of :class:`LaunchOptions` and stores
    them parsed in the groups below (see the module docstring).
    """

    workers: WorkerOptions
    output: OutputOptions
    stop: StopOptions
    world: WorldOptions
    watch: WatchOptions
    restarts: RestartOptions
    rendezvous: RendezvousOptions
    health: HealthOptions
    parallel: object | None
    """A ``rallypoint.distributed`` parallel layout: ``launch`` then wraps ``fn`` with
    ``rallypoint.distributed.parallel_worker(fn, parallel)``."""

    def __init__(self, **options: Unpack[LaunchOptions]) -> None:
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:
            raise TypeError(f"LaunchConfig() got an unexpected keyword argument {unknown[0]!r}")
        flat: Mapping[str, Any] = options
        init = object.__setattr__
        init(self, "workers", _workers(flat))
        init(self, "rendezvous", _rendezvous(flat))
        init(self, "health", _health(flat))
        init(self, "watch", _watch(flat))
        init(self, "restarts", _restarts(flat))
        init(self, "stop", _stop(flat))
        init(self, "world", _world(flat))
        init(self, "output", _output(flat))
        init(self, "parallel", flat.get("parallel"))
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

    # ------------------------------------------------------------------ flat read-back
    nproc = _Flat[int]("workers")
    role = _Flat[str]("workers")
    start_method = _Flat[Literal["fork", "spawn"]]("workers")
    preload = _Flat[tuple[str, ...]]("workers")
    env = _Flat[Mapping[str, str]]("workers")
    cwd = _Flat[str | None]("workers")
    virtual_local_rank = _Flat[bool]("workers")
    numa_binding = _Flat[str | None]("workers")
    spare_workers = _Flat[int]("workers")
    log_dir = _Flat[str | None]("output")
    redirects = _Flat[StdSpec]("output")
    tee = _Flat[StdSpec]("output")
    local_ranks_filter = _Flat[frozenset[int] | None]("output")
    prefix = _Flat[str | None]("output")
    duplicate_stdout_filters = _Flat[tuple[str, ...]]("output")
    duplicate_stderr_filters = _Flat[tuple[str, ...]]("output")
    monitor_interval = _Flat[timedelta]("stop")
    shutdown_timeout = _Flat[timedelta]("stop")
    restart_grace = _Flat[timedelta]("stop")
    timeout = _Flat[timedelta | None]("stop")
    master_addr = _Flat[str]("world")
    master_port = _Flat[int | None]("world")
    rank_offset = _Flat[int]("world")
    world_size = _Flat[int | None]("world")
    run_id = _Flat[str | None]("world")
    hang_timeout = _Flat[timedelta | None]("watch")
    events = _Flat[str | None]("watch")
    straggler_threshold = _Flat[float | None]("watch")
    straggler_window = _Flat[timedelta]("watch")
    flight_recorder = _Flat[int | None]("watch")
    max_restarts = _Flat[int]("restarts")
    on_hang = _Flat[Literal["restart", "fail"]]("restarts")
    max_same_failure = _Flat[int | None]("restarts")
    max_node_failures = _Flat[int | None]("restarts")
    burn_in = _Flat[bool]("restarts")
    hot_spare = _Flat[bool]("restarts")
    rdzv_backend = _Flat[str]("rendezvous", "backend")
    rdzv_endpoint = _Flat[str]("rendezvous", "endpoint")
    rdzv_conf = _Flat[Mapping[str, str]]("rendezvous", "conf")
    node_rank = _Flat[int | None]("rendezvous")
    local_addr = _Flat[str | None]("rendezvous")
    health_check = _Flat[tuple[str, ...]]("health", "checks")
    health_check_timeout = _Flat[timedelta]("health", "timeout")
    min_nodes = _Flat[int]("rendezvous")
    max_nodes = _Flat[int]("rendezvous")
    multi_node = _Flat[bool]("rendezvous")
    """Whether this launch runs the elastic coordinator (a rendezvous of several nodes)."""

    @property
    def nnodes(self) -> str:
        """``N`` or ``MIN:MAX``."""
        return self.rendezvous.nnodes

    @property
    def signals_to_handle(self) -> str:
        """The signals forwarded to the workers, as on the command line."""
        return ",".join(self.stop.signals_to_handle)

    @property
    def total_world_size(self) -> int:
        """The job's world size: ``world_size`` if given, else ``nproc``."""
        return self.world.world_size or self.workers.nproc

    def std_mask(self, which: Literal["redirects", "tee"], local_rank: int) -> int:
        """The stream mask (1 stdout, 2 stderr) that ``redirects``/``tee`` give ``local_rank``."""
        return self.output.std_mask(which, local_rank)


def _restarts(o: Mapping[str, Any]) -> RestartOptions:
    names = (
        "max_restarts", "on_hang", "max_same_failure", "max_node_failures", "burn_in",
        "hot_spare",
    )  # fmt: skip
    return RestartOptions(**_pick(o, *names))
