"""Run a function inside ready process groups: what ``launch(..., parallel=...)`` uses.

:func:`parallel_worker` wraps ``fn`` in a picklable callable (a module-level class, not a
closure, so that it crosses ``spawn`` and ``forkserver`` as well as ``fork``). In each
worker it resolves the config from the environment the launcher set, creates the default
process group and the parallel groups, calls ``fn`` and destroys every group afterwards,
also when ``fn`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from rallypoint._core.checks import check_int
from rallypoint.distributed._config import DistributedConfig, check_layout
from rallypoint.distributed._init import destroy_process_group
from rallypoint.distributed._mesh import init_parallel_groups

T = TypeVar("T")


class ParallelWorker(Generic[T]):
    """``fn`` run between ``init_parallel_groups(config)`` and ``destroy_process_group()``."""

    __slots__ = ("config", "fn")

    def __init__(self, fn: Callable[..., T], config: DistributedConfig) -> None:
        self.fn = fn
        self.config = config

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        init_parallel_groups(self.config)
        try:
            return self.fn(*args, **kwargs)
        finally:
            destroy_process_group()

    def __getstate__(self) -> tuple[Callable[..., T], DistributedConfig]:
        return (self.fn, self.config)

    def __setstate__(self, state: tuple[Callable[..., T], DistributedConfig]) -> None:
        self.fn, self.config = state

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"ParallelWorker({name}, {self.config!r})"


def _as_config(parallel: object) -> DistributedConfig:
    if isinstance(parallel, DistributedConfig):
        return parallel
    if parallel is True:
        return DistributedConfig()
    if isinstance(parallel, Mapping):
        unknown = sorted(set(parallel) - set(DistributedConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"parallel has unknown keys {unknown}: use DistributedConfig's fields, e.g. "
                f"parallel={{'tensor_parallel': 2}}"
            )
        return DistributedConfig(**parallel)
    raise TypeError(
        f"parallel must be a DistributedConfig, a mapping of its fields or True, got "
        f"{type(parallel).__name__}; e.g. parallel=DistributedConfig(tensor_parallel=2)"
    )


def parallel_worker(
    fn: Callable[..., T], parallel: object, *, world_size: int | None = None
) -> ParallelWorker[T]:
    """Wrap ``fn`` so that it runs with the process group and parallel groups ready.

    ``parallel`` is a :class:`DistributedConfig`, a mapping of its fields
    (``{"tensor_parallel": 2}``) or ``True`` (data parallel over the whole world). Its
    identity fields are normally left unset: each worker reads them from the environment
    its launcher set (``RANK`` already includes any ``rank_offset``). Bad input raises
    here, in the launching process, before any worker starts; a launcher that knows the
    ``world_size`` passes it so that sizes which do not divide it fail here too.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    config = _as_config(parallel)
    if world_size is not None:
        check_int(world_size, "world_size", minimum=1)
        if config.world_size is not None and config.world_size != world_size:
            raise ValueError(
                f"parallel.world_size is {config.world_size} but the launch has {world_size} "
                f"processes: leave world_size unset in the parallel config"
            )
        check_layout(world_size, config.sizes)
    return ParallelWorker(fn, config)
