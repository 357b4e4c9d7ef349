"""Data-, context-, tensor- and pipeline-parallel groups on one torch ``DeviceMesh``.

The mesh has the four named dimensions ``("pp", "dp", "cp", "tp")``, outermost first, so
that global rank = ((pp * DP + dp) * CP + cp) * TP + tp: tensor-parallel ranks are
consecutive (they share the fastest links, e.g. one node's NVLink), pipeline stages are
the farthest apart. Dimensions of size 1 are kept, so every accessor works for every
layout (a size-1 group holds just this rank).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rallypoint.distributed._config import (
    DIM_FIELDS,
    DIM_NAMES,
    DistributedConfig,
    check_backend_name,
    check_layout,
    with_overrides,
)
from rallypoint.distributed._errors import AlreadyInitializedError, NotInitializedError
from rallypoint.distributed._init import _check_available, _uses_cuda, init_process_group
from rallypoint.distributed._state import STATE

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("rallypoint.distributed")


def _check_dim(dim: str) -> str:
    if dim not in DIM_NAMES:
        raise ValueError(f"unknown parallel dimension {dim!r}: use one of {', '.join(DIM_NAMES)}")
    return dim


class ParallelGroups:
    """This rank's view of the parallel layout: a group, rank and size per dimension.

    ``group("tp")`` is the tensor-parallel process group this rank belongs to,
    ``rank("tp")`` its rank inside it, ``size("tp")`` its size, ``ranks("tp")`` the
    global ranks in it; ``mesh`` is the underlying ``DeviceMesh`` (slice it with
    ``mesh["dp"]`` or ``mesh["dp", "tp"]`` for DTensor / FSDP). The ``dp_group``,
    ``tp_rank``, ``pp_size``, ... properties are shorthands.
    """

    __slots__ = ("_backends", "_mesh", "_sizes")

    def __init__(self, mesh: DeviceMesh, sizes: Mapping[str, int], backends: Mapping[str, str]):
        self._mesh = mesh
        self._sizes = dict(sizes)
        self._backends = dict(backends)

    @property
    def mesh(self) -> DeviceMesh:
        """The ``DeviceMesh`` with dimensions ``("pp", "dp", "cp", "tp")``."""
        return self._mesh

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every dimension, e.g. ``{"pp": 1, "dp": 2, "cp": 1, "tp": 2}``."""
        return dict(self._sizes)

    @property
    def dim_backends(self) -> dict[str, str]:
        """The backends asked for per dimension (the others use the default group's)."""
        return dict(self._backends)

    def group(self, dim: str) -> ProcessGroup:
        """The process group of this rank along ``dim``."""
        return self._mesh.get_group(_check_dim(dim))

    def rank(self, dim: str) -> int:
        """This rank's index inside its ``dim`` group (its coordinate along ``dim``)."""
        return int(self._mesh.get_local_rank(_check_dim(dim)))

    def size(self, dim: str) -> int:
        """The number of ranks in each ``dim`` group."""
        return self._sizes[_check_dim(dim)]

    def ranks(self, dim: str) -> list[int]:
        """The global ranks in this rank's ``dim`` group, in group-rank order."""
        import torch.distributed as dist

        return [int(r) for r in dist.get_process_group_ranks(self.group(dim))]

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on the mesh, by dimension name."""
        return {dim: self.rank(dim) for dim in DIM_NAMES}

    # shorthands -------------------------------------------------------------------
    @property
    def dp_group(self) -> ProcessGroup:
        return self.group("dp")

    @property
    def tp_group(self) -> ProcessGroup:
        return self.group("tp")

    @property
    def pp_group(self) -> ProcessGroup:
        return self.group("pp")

    @property
    def cp_group(self) -> ProcessGroup:
        return self.group("cp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")

    @property
    def cp_rank(self) -> int:
        return self.rank("cp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage."""
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        sizes = ", ".join(f"{dim}={self._sizes[dim]}" for dim in DIM_NAMES)
        return f"ParallelGroups({sizes}, coordinate={self.coordinate})"


def init_parallel_groups(
    config: DistributedConfig | None = None,
    *,
    data_parallel: int | None = None,
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    context_parallel: int | None = None,
    dim_backends: Mapping[str, str] | None = None,
) -> ParallelGroups:
    """Create the parallel groups (and the default process group if needed).

    Sizes given as arguments override ``config``'s; ``data_parallel=-1`` (the default)
    takes what remains of the world. ``dim_backends={"tp": "gloo"}`` gives a dimension
    its own backend (passed to ``init_device_mesh(backend_override=...)``).

    Calling it again with the same layout returns the existing groups; another layout
    raises :class:`AlreadyInitializedError` (call :func:`destroy_process_group` first).

    A collective over the whole world: it returns on a rank only once every rank has
    created all of its groups (one 1-element all-reduce on the default group). torch's
    ``new_group`` does not synchronise the ranks, and gloo's pair handshake can finish on
    one side first, so a rank that went on and exited at once could otherwise close a
    socket, or the store it hosts, while a peer is still connecting (``Gloo
    connectFullMesh failed ... Connection closed by peer``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    base = with_overrides(
        config,
        {
            "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel,
            "context_parallel": context_parallel,
            "dim_backends": dim_backends,
        },
    )
    backends = {
        dim: check_backend_name(name, f" (dim_backends[{dim!r}])")
        for dim, name in base.dim_backends.items()
    }
    init_process_group(config=base)  # also forgets groups of a default group torch destroyed
    world_size = dist.get_world_size()
    sizes = base.sizes
    sizes["dp"] = check_layout(world_size, sizes)
    existing = STATE.parallel
    if existing is not None:
        if existing.sizes == sizes and existing.dim_backends == backends:
            return existing
        raise AlreadyInitializedError(
            f"parallel groups already exist with sizes {existing.sizes} and dim_backends "
            f"{existing.dim_backends}; this call asks for {sizes} and {backends}: call "
            f"destroy_process_group() first, or pass the same layout"
        )
    for name in backends.values():
        _check_available(name)
    default_backend = str(dist.get_backend())
    device_type = "cuda" if _uses_cuda(default_backend) else "cpu"
    mesh = init_device_mesh(
        device_type,
        tuple(sizes[dim] for dim in DIM_NAMES),
        mesh_dim_names=DIM_NAMES,
        # dict[str, str] is a valid backend_override; the annotation (an invariant dict of a
        # wider union) rejects it
        backend_override=dict(backends) if backends else None,  # type: ignore[arg-type]
    )
    groups = ParallelGroups(mesh, sizes, backends)
    _wait_for_every_rank(device_type)  # every rank has created every group (see above)
    STATE.parallel = groups
    log.info(
        "parallel groups on rank %d: %s",
        dist.get_rank(),
        ", ".join(f"{DIM_FIELDS[dim]}={sizes[dim]} (rank {groups.rank(dim)})" for dim in DIM_NAMES),
    )
    return groups


def _wait_for_every_rank(device_type: str) -> None:
    """Return once every rank got here: one 1-element all-reduce on the default group;
    ``.item()`` waits on the host also where the collective is asynchronous to it (NCCL)."""
    import torch
    import torch.distributed as dist

    probe = torch.zeros(1, device=device_type)
    dist.all_reduce(probe)
    probe.item()


def get_parallel_groups() -> ParallelGroups:
    """The groups made by :func:`init_parallel_groups` in this process."""
    STATE.sync()
    groups = STATE.parallel
    if groups is None:
        raise NotInitializedError(
            "parallel groups are not initialised in this process: call "
            "rallypoint.distributed.init_parallel_groups() first, or start the workers with "
            "rallypoint.launch(fn, ..., parallel=DistributedConfig(...))"
        )
    return groups
