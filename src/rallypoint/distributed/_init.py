"""The default process group: created from the environment or a config, checked first.

Differences from ``torch.distributed.init_process_group``:

- every input is checked before anything touches the network: a multi-process world
  without ``MASTER_ADDR`` is a ``ValueError`` at once, not a wait on a store that nobody
  hosts; ``nccl`` without CUDA is a :class:`BackendUnavailableError`;
- the backend is chosen automatically (``nccl`` with CUDA, else ``gloo``), and the
  ``TORCH_DISTRIBUTED_BACKEND`` environment variable overrides that choice;
- calling it again is a no-op when the settings match, and an
  :class:`AlreadyInitializedError` saying what differs when they do not;
- one warm-up ``all_reduce`` proves the group works before the call returns.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rallypoint._core.net import free_port
from rallypoint.distributed._config import (
    DistributedConfig,
    _resolve,
    check_backend_name,
    with_overrides,
)
from rallypoint.distributed._errors import AlreadyInitializedError, BackendUnavailableError
from rallypoint.distributed._state import STATE

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import Store

log = logging.getLogger("rallypoint.distributed")

# fields compared when init_process_group is called again
_COMPARED = (
    "backend",
    "init_method",
    "world_size",
    "rank",
    "master_addr",
    "master_port",
    "timeout",
)


def _backend_parts(spec: str) -> list[tuple[str | None, str]]:
    """``"cpu:gloo,cuda:nccl"`` -> ``[("cpu", "gloo"), ("cuda", "nccl")]``; ``"gloo"`` ->
    ``[(None, "gloo")]``."""
    parts: list[tuple[str | None, str]] = []
    for part in spec.split(","):
        device, _, name = part.strip().rpartition(":")
        parts.append((device or None, name.strip()))
    return parts


def _uses_cuda(spec: str) -> bool:
    """Whether the group will run on CUDA devices (so the device must be set)."""
    import torch

    for device, name in _backend_parts(spec):
        if device is None and name == "nccl":
            return True
        if device == "cuda" and torch.cuda.is_available():
            return True
    return False


def _check_available(spec: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    for device, name in _backend_parts(spec):
        # a per-device part for CUDA is never used without CUDA; it only has to be built in
        if name == "nccl" and not cuda and device != "cuda":
            raise BackendUnavailableError(
                "backend 'nccl' needs CUDA, but torch.cuda.is_available() is False on this "
                "machine: use backend='gloo', or leave the backend unset to choose automatically"
            )
        if not dist.is_backend_available(name):
            raise BackendUnavailableError(
                f"backend {name!r} is not available in this torch build "
                f"(torch {torch.__version__}): use backend='gloo'"
            )


def _requested(
    config: DistributedConfig | None, overrides: dict[str, Any]
) -> tuple[DistributedConfig, dict[str, Any]]:
    """The config to resolve and the fields the caller set explicitly."""
    base = with_overrides(config, overrides)
    explicit = {key: getattr(base, key) for key in _COMPARED if getattr(base, key) is not None}
    if "backend" in explicit:
        explicit["backend"] = check_backend_name(explicit["backend"])
    return base, explicit


def _existing_group(explicit: dict[str, Any]) -> ProcessGroup:
    """Return the default group if ``explicit`` agrees with it, else raise."""
    import torch.distributed as dist

    recorded = STATE.config
    if recorded is not None:
        current: dict[str, Any] = {key: getattr(recorded, key) for key in _COMPARED}
        how = "by rallypoint.distributed.init_process_group"
    else:  # initialised directly with torch: compare what torch can tell
        current = {
            "backend": str(dist.get_backend()),
            "world_size": dist.get_world_size(),
            "rank": dist.get_rank(),
        }
        how = "by torch.distributed.init_process_group"
    differences = [
        f"{key}: {current[key]!r} now, {value!r} requested"
        for key, value in explicit.items()
        if key in current and current[key] != value
    ]
    if differences:
        raise AlreadyInitializedError(
            f"the default process group was already initialised {how} with other settings "
            f"({'; '.join(differences)}): call destroy_process_group() first, or pass the "
            f"same settings"
        )
    world = dist.group.WORLD
    assert world is not None
    return world


# TCPStore servers this process hosts for env:// (rank 0), kept for the process lifetime so
# that re-initialising on the same port reuses a live server.
_HOSTED_STORES: dict[tuple[str, int], Store] = {}


def _make_store(config: DistributedConfig, environ: dict[str, str], generation: int) -> Store:
    """The TCPStore for ``env://``: a client of the launcher's store, or hosted by rank 0."""
    from torch.distributed.distributed_c10d import PrefixStore

    from rallypoint._core.torch_c import TCPStore

    assert config.master_addr is not None and config.master_port is not None
    assert config.world_size is not None and config.rank is not None
    assert config.timeout is not None
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        host_name=config.master_addr,
        port=config.master_port,
        world_size=config.world_size,
        is_master=not agent_store and config.rank == 0,
        timeout=config.timeout,
        multi_tenant=not agent_store,
    )
    if not agent_store and config.rank == 0:
        # torch caches multi-tenant servers by weak reference: without this the server
        # would stop with the destroyed group, and a rank that re-inits quickly could
        # connect to it just before it goes away (DistNetworkError: Broken pipe).
        _HOSTED_STORES[(config.master_addr, config.master_port)] = store
    # The prefix torch uses for env://. rank 0's multi-tenant server outlives a destroyed
    # group in this process, so a later init on the same port gets its own namespace
    # (every rank counts its inits alike when they init and destroy in step).
    prefix = "default_pg" if generation == 0 else f"default_pg/rallypoint_reinit_{generation}"
    return PrefixStore(prefix, store)


def _set_device(config: DistributedConfig) -> torch.device:
    import torch

    assert config.backend is not None and config.local_rank is not None
    if not _uses_cuda(config.backend):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if config.local_rank >= count:
        raise ValueError(
            f"local_rank {config.local_rank} has no CUDA device: this machine has {count}; "
            f"run at most {count} processes per node (e.g. --nproc-per-node {count})"
        )
    torch.cuda.set_device(config.local_rank)
    return torch.device("cuda", config.local_rank)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    *,
    config: DistributedConfig | None = None,
    store: Store | None = None,
    warmup: bool = True,
) -> ProcessGroup:
    """Create the default process group and return it.

    Arguments override the fields of ``config``, which override the environment (see
    :meth:`DistributedConfig.resolve`). ``world_size=-1`` and ``rank=-1`` mean "not
    given", as in torch. With ``store`` the rendezvous uses that store (``rank`` and
    ``world_size`` then come from the arguments, config or environment as usual).

    Returns the existing group when this process is already initialised with the same
    settings (only the settings passed explicitly are compared); raises
    :class:`AlreadyInitializedError` naming the differences otherwise.
    """
    import os

    import torch.distributed as dist

    overrides: dict[str, Any] = {
        "backend": backend,
        "init_method": init_method,
        "timeout": timeout,
        "world_size": None if world_size == -1 else world_size,
        "rank": None if rank == -1 else rank,
    }
    base, explicit = _requested(config, overrides)
    if store is not None and base.init_method is not None:
        raise ValueError("pass either store= or init_method=, not both")
    STATE.sync()
    if dist.is_initialized():
        return _existing_group(explicit)

    environ = dict(os.environ)
    resolved = _resolve(base, environ, free_port, need_master=store is None)
    assert resolved.backend is not None and resolved.timeout is not None
    _check_available(resolved.backend)
    device = _set_device(resolved)
    kwargs, method = _torch_arguments(resolved, device, store, environ)
    dist.init_process_group(**kwargs)
    STATE.generation += 1
    world = dist.group.WORLD
    assert world is not None
    STATE.config, STATE.group = resolved, world
    if warmup:
        _warm_up(device, resolved.world_size)
    log.info(
        "initialised process group: rank %d of %d (local %d of %d), backend %s, init %s",
        resolved.rank,
        resolved.world_size,
        resolved.local_rank,
        resolved.local_world_size,
        resolved.backend,
        method,
    )
    return world


def _torch_arguments(
    resolved: DistributedConfig,
    device: torch.device,
    store: Store | None,
    environ: dict[str, str],
) -> tuple[dict[str, Any], str]:
    """The keyword arguments of torch's ``init_process_group`` and how it rendezvouses
    (for the log): the given store, a TCPStore for ``env://``, or the init method."""
    kwargs: dict[str, Any] = {
        "backend": resolved.backend,
        "timeout": resolved.timeout,
        "world_size": resolved.world_size,
        "rank": resolved.rank,
    }
    if device.type != "cpu":
        kwargs["device_id"] = device
    if store is not None:
        kwargs["store"] = store
        return kwargs, "store"
    if resolved.init_method == "env://":
        kwargs["store"] = _make_store(resolved, environ, STATE.generation)
        return kwargs, f"env:// ({resolved.master_addr}:{resolved.master_port})"
    kwargs["init_method"] = resolved.init_method
    return kwargs, str(resolved.init_method)


def _warm_up(device: torch.device, world_size: int | None) -> None:
    """One ``all_reduce`` that proves the group works before ``init_process_group`` returns."""
    import torch
    import torch.distributed as dist

    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise AssertionError(f"warm-up all_reduce returned {probe.item()}")


def destroy_process_group() -> None:
    """Destroy the parallel groups and the default group; a no-op when none exists.

    Safe to call in a ``finally`` block: it never raises because nothing was initialised.
    """
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            log.debug("destroyed the default process group and its subgroups")
    finally:
        STATE.clear()
