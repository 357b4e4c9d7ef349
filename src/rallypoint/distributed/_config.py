"""The configuration of a worker's process groups: identity, rendezvous, backend, layout.

A :class:`DistributedConfig` holds what the caller knows; ``None`` means "take it from the
environment that ``rallypoint run`` / torchrun set, or choose a default".
:meth:`DistributedConfig.resolve` returns a copy with every field filled in and checked,
reading the environment exactly once, so that the rest of the package never looks at
``os.environ`` itself.

The parallel layout has four named dimensions, outermost first: ``pp`` (pipeline), ``dp``
(data), ``cp`` (context/sequence) and ``tp`` (tensor). Tensor parallelism is innermost, so
consecutive ranks share a tensor-parallel group (as in Megatron-LM and torchtitan).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

from rallypoint._core.checks import check_int
from rallypoint._core.net import free_port

#: Mesh dimension names, outermost first (the order of the mesh shape).
DIM_NAMES: tuple[str, ...] = ("pp", "dp", "cp", "tp")

#: Dimension name -> the config field that holds its size.
DIM_FIELDS: dict[str, str] = {
    "pp": "pipeline_parallel",
    "dp": "data_parallel",
    "cp": "context_parallel",
    "tp": "tensor_parallel",
}

#: Backends torch builds in; plugins registered with ``Backend.register_backend`` also count.
BUILTIN_BACKENDS: tuple[str, ...] = ("gloo", "mpi", "nccl", "ucc", "xccl")

#: Rendezvous schemes ``init_method`` may use (torch's built-in handlers).
INIT_METHOD_SCHEMES: tuple[str, ...] = ("env", "tcp", "file")

BACKEND_ENV = "TORCH_DISTRIBUTED_BACKEND"


def _product_text(sizes: Mapping[str, int], *, include_dp: bool) -> tuple[str, int]:
    """``("tensor_parallel * pipeline_parallel", 4)`` for the sizes other than 1."""
    names = [
        DIM_FIELDS[dim]
        for dim in ("tp", "cp", "dp", "pp")
        if (include_dp or dim != "dp") and sizes[dim] != 1
    ]
    product = math.prod(sizes[dim] for dim in DIM_NAMES if include_dp or dim != "dp")
    return (" * ".join(names) if names else "tensor_parallel"), product


def check_layout(world_size: int, sizes: Mapping[str, int]) -> int:
    """Check that the sizes fit ``world_size`` and return the data-parallel size.

    ``sizes["dp"] == -1`` means "what remains". Raises ``ValueError`` naming the fix.
    """
    text, known = _product_text(sizes, include_dp=False)
    if world_size % known != 0:
        raise ValueError(
            f"world_size {world_size} is not divisible by {text} = {known}: choose parallel "
            f"sizes whose product divides {world_size}, or run {known} * k processes"
        )
    if sizes["dp"] == -1:
        return world_size // known
    text, total = _product_text(sizes, include_dp=True)
    if total != world_size:
        raise ValueError(
            f"{text} = {total} does not equal world_size {world_size}: set data_parallel=-1 "
            f"to infer it (it would be {world_size // known}), or change the sizes"
        )
    return sizes["dp"]


def check_backend_name(backend: str, source: str = "") -> str:
    """Return ``backend`` lowercased, or raise ``ValueError`` listing the valid names.

    Composite specs such as ``"cpu:gloo,cuda:nccl"`` are accepted, as torch accepts them.
    """
    import torch.distributed as dist

    valid = set(BUILTIN_BACKENDS) | {name.lower() for name in dist.Backend._plugins}
    spec = backend.strip().lower()
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) == 1 and ":" not in parts[0]:
        names = parts
    else:  # "cpu:gloo,cuda:nccl": every part names its device
        names = [part.split(":", 1)[1] if ":" in part else "" for part in parts]
    for name in names:
        if name.strip() not in valid:
            raise ValueError(
                f"unknown backend {backend!r}{source}: valid backends are "
                f"{', '.join(sorted(valid))} (or a per-device spec such as 'cpu:gloo,cuda:nccl')"
            )
    return spec


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class DistributedConfig:
    """How this worker joins the job and how the world is split into parallel groups.

    Every identity field left ``None`` is read from the environment by :meth:`resolve`
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``TORCH_DISTRIBUTED_BACKEND``), then defaulted.

    Parallel sizes: ``data_parallel=-1`` (the default) means "whatever remains after
    tensor, pipeline and context parallelism". ``dim_backends`` maps a dimension name
    (``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``) to the backend of that dimension's groups.
    """

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str | None = None
    backend: str | None = None
    timeout: timedelta | None = None
    data_parallel: int = -1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    dim_backends: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int(self.rank, "rank", minimum=0, allow_none=True)
        check_int(self.local_rank, "local_rank", minimum=0, allow_none=True)
        check_int(self.world_size, "world_size", minimum=1, allow_none=True)
        check_int(self.local_world_size, "local_world_size", minimum=1, allow_none=True)
        check_int(self.master_port, "master_port", minimum=1, maximum=65535, allow_none=True)
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size}: "
                f"ranks run from 0 to {self.world_size - 1}"
            )
        if (
            self.local_rank is not None
            and self.local_world_size is not None
            and self.local_rank >= self.local_world_size
        ):
            raise ValueError(
                f"local_rank {self.local_rank} is out of range for local_world_size "
                f"{self.local_world_size}"
            )
        if (
            self.local_world_size is not None
            and self.world_size is not None
            and self.local_world_size > self.world_size
        ):
            raise ValueError(
                f"local_world_size {self.local_world_size} exceeds world_size {self.world_size}"
            )
        if self.master_addr is not None and (
            not isinstance(self.master_addr, str) or not self.master_addr
        ):
            raise TypeError(f"master_addr must be a non-empty str, got {self.master_addr!r}")
        if self.init_method is not None:
            if not isinstance(self.init_method, str):
                raise TypeError(f"init_method must be a str, got {self.init_method!r}")
            scheme = self.init_method.split("://", 1)[0] if "://" in self.init_method else ""
            if scheme not in INIT_METHOD_SCHEMES:
                raise ValueError(
                    f"init_method {self.init_method!r} is not a URL this package understands: "
                    f"use 'env://', 'tcp://HOST:PORT' or 'file:///PATH'"
                )
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise TypeError(f"backend must be a non-empty str, got {self.backend!r}")
        if self.timeout is not None:
            if not isinstance(self.timeout, timedelta):
                raise TypeError(
                    f"timeout must be a datetime.timedelta, got {type(self.timeout).__name__}; "
                    f"e.g. timeout=timedelta(minutes=5)"
                )
            if self.timeout <= timedelta(0):
                raise ValueError(f"timeout must be positive, got {self.timeout}")
        for dim in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            check_int(getattr(self, dim), dim, minimum=1)
        check_int(self.data_parallel, "data_parallel", minimum=-1)
        if self.data_parallel == 0:
            raise ValueError("data_parallel must be >= 1, or -1 to infer it from world_size")
        if not isinstance(self.dim_backends, Mapping):
            raise TypeError(
                f"dim_backends must be a mapping such as {{'tp': 'gloo'}}, "
                f"got {type(self.dim_backends).__name__}"
            )
        for dim, backend in self.dim_backends.items():
            if dim not in DIM_NAMES:
                raise ValueError(
                    f"dim_backends has unknown dimension {dim!r}: use one of {', '.join(DIM_NAMES)}"
                )
            if not isinstance(backend, str) or not backend:
                raise TypeError(f"dim_backends[{dim!r}] must be a backend name, got {backend!r}")
        object.__setattr__(self, "dim_backends", dict(self.dim_backends))
        if self.world_size is not None:
            check_layout(self.world_size, self.sizes)

    @property
    def sizes(self) -> dict[str, int]:
        """The size of each dimension by name (``dp`` may be -1 before :meth:`resolve`)."""
        return {dim: int(getattr(self, DIM_FIELDS[dim])) for dim in DIM_NAMES}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh shape ``(pp, dp, cp, tp)``; needs a resolved config."""
        if self.data_parallel == -1:
            raise ValueError("mesh_shape needs data_parallel; call resolve() first")
        return tuple(self.sizes[dim] for dim in DIM_NAMES)

    def replace(self, **changes: Any) -> DistributedConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def resolve(self, environ: Mapping[str, str] | None = None) -> DistributedConfig:
        """Return a copy with every field filled in from ``environ`` (default ``os.environ``).

        Fields given explicitly win over the environment. Defaults: world size from the
        CUDA device count (1 on CPU), local world size = world size, local rank = rank
        modulo local world size, backend ``nccl`` when CUDA is available else ``gloo``
        (``TORCH_DISTRIBUTED_BACKEND`` overrides that choice), and for a single process a
        loopback master address and a free port. A multi-process world without
        ``MASTER_ADDR``/``MASTER_PORT`` (and without a non-``env://`` init method) is an
        error here, before anything touches the network.
        """
        return _resolve(self, os.environ if environ is None else environ, free_port)


def with_overrides(
    config: DistributedConfig | None, overrides: Mapping[str, Any]
) -> DistributedConfig:
    """``config`` (a default one if ``None``) with the ``overrides`` that are not ``None``."""
    base = DistributedConfig() if config is None else config
    if not isinstance(base, DistributedConfig):
        raise TypeError(
            f"config must be a DistributedConfig, got {type(base).__name__}; "
            f"e.g. config=DistributedConfig(tensor_parallel=2)"
        )
    changes = {key: value for key, value in overrides.items() if value is not None}
    return base.replace(**changes) if changes else base


def _resolve(
    config: DistributedConfig,
    environ: Mapping[str, str],
    pick_port: Callable[[], int],
    *,
    need_master: bool = True,
) -> DistributedConfig:
    """:meth:`DistributedConfig.resolve`; ``need_master=False`` when a store is given."""
    import torch

    cuda = torch.cuda.is_available()
    identity = _resolve_identity(config, environ, cuda)
    backend = _resolve_backend(config, environ, cuda)
    init_method = config.init_method or "env://"
    master_addr, master_port = _resolve_master(
        config, environ, init_method, identity.world_size, pick_port, need_master=need_master
    )
    resolved = dataclasses.replace(
        config,
        **identity._asdict(),
        timeout=config.timeout if config.timeout is not None else _default_timeout(backend),
        master_addr=master_addr,
        master_port=master_port,
        init_method=init_method,
        backend=backend,
    )
    dp = check_layout(identity.world_size, resolved.sizes)
    return dataclasses.replace(resolved, data_parallel=dp)


class _Identity(NamedTuple):
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def _resolve_identity(
    config: DistributedConfig, environ: Mapping[str, str], cuda: bool
) -> _Identity:
    """``rank``, ``local_rank``, ``world_size``, ``local_world_size``: given, from the
    environment, or defaulted."""
    world_size = config.world_size
    if world_size is None:
        world_size = _env_int(environ, "WORLD_SIZE")
    if world_size is None:
        import torch

        world_size = torch.cuda.device_count() if cuda else 1
    rank = config.rank if config.rank is not None else _env_int(environ, "RANK")
    if rank is None:
        if world_size != 1:
            raise ValueError(
                f"RANK is not set and world_size is {world_size}: start the job with "
                f"`rallypoint run` (or torchrun), which sets RANK, or pass rank="
            )
        rank = 0
    local_world_size = config.local_world_size
    if local_world_size is None:
        local_world_size = _env_int(environ, "LOCAL_WORLD_SIZE") or world_size
    local_rank = config.local_rank
    if local_rank is None:
        local_rank = _env_int(environ, "LOCAL_RANK")
    if local_rank is None:
        local_rank = rank % local_world_size
    return _Identity(rank, local_rank, world_size, local_world_size)


def _resolve_backend(config: DistributedConfig, environ: Mapping[str, str], cuda: bool) -> str:
    """The backend given, else ``TORCH_DISTRIBUTED_BACKEND``, else nccl/gloo; checks the
    per-dimension backends too."""
    if config.backend:
        backend = check_backend_name(config.backend)
    elif environ.get(BACKEND_ENV):
        backend = check_backend_name(environ[BACKEND_ENV], f" (from {BACKEND_ENV})")
    else:
        backend = "nccl" if cuda else "gloo"
    for dim, dim_backend in config.dim_backends.items():
        check_backend_name(dim_backend, f" (dim_backends[{dim!r}])")
    return backend


def _resolve_master(
    config: DistributedConfig,
    environ: Mapping[str, str],
    init_method: str,
    world_size: int,
    pick_port: Callable[[], int],
    *,
    need_master: bool,
) -> tuple[str | None, int | None]:
    """``MASTER_ADDR``/``MASTER_PORT`` for ``env://`` (loopback and a free port for one
    process), or the host and port of a ``tcp://`` init method."""
    master_addr, master_port = config.master_addr, config.master_port
    if init_method.startswith("env://") and need_master:
        master_addr = master_addr or environ.get("MASTER_ADDR") or None
        if master_port is None:
            master_port = _env_int(environ, "MASTER_PORT")
        if world_size == 1:
            master_addr = master_addr or "127.0.0.1"
            master_port = master_port if master_port is not None else pick_port()
        if master_addr is None:
            raise ValueError(
                f"MASTER_ADDR is not set and world_size is {world_size}: start the job with "
                f"`rallypoint run` (or torchrun), which sets it, or set MASTER_ADDR and "
                f"MASTER_PORT, or pass master_addr= and master_port="
            )
        if master_port is None:
            raise ValueError(
                f"MASTER_PORT is not set and world_size is {world_size}: start the job with "
                f"`rallypoint run` (or torchrun), or set MASTER_PORT, or pass master_port="
            )
    elif init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].partition("?")[0].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"init_method {init_method!r} must look like 'tcp://HOST:PORT'")
        master_addr, master_port = host.strip("[]"), int(port)
    return master_addr, master_port


def _default_timeout(backend: str) -> timedelta:
    """torch's default: its NCCL timeout for ``nccl``, else the process-group timeout."""
    from torch.distributed import constants

    nccl_timeout = constants.default_pg_nccl_timeout
    if backend == "nccl" and nccl_timeout is not None:
        return nccl_timeout
    return constants.default_pg_timeout
