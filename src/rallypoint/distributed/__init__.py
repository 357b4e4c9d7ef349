"""Process groups and parallel layouts: the first thing a training script calls.

Turns the environment set by ``rallypoint run`` / ``rallypoint.launch`` (or torchrun), or
an explicit :class:`DistributedConfig`, into a ready default process group and named
data/context/tensor/pipeline-parallel groups on a torch ``DeviceMesh``; adds collectives
that autograd can differentiate through.

Public names:

- :class:`DistributedConfig`: identity, rendezvous, backend and parallel sizes; ``resolve()``
- :func:`init_process_group` / :func:`destroy_process_group`
- :func:`init_parallel_groups` / :func:`get_parallel_groups` / :class:`ParallelGroups`
- :func:`parallel_worker` / :class:`ParallelWorker`: what ``launch(..., parallel=...)`` runs
- :func:`all_to_all`, :func:`all_gather`, :func:`reduce_scatter`: differentiable collectives
- errors: :class:`DistributedError` and its subclasses (tree in ``_errors``)

Importing this package does not import torch; the collectives load it on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes
from rallypoint._core.public import set_public_module
from rallypoint.distributed._config import DIM_NAMES, DistributedConfig
from rallypoint.distributed._errors import (
    AlreadyInitializedError,
    BackendUnavailableError,
    DistributedError,
    NotInitializedError,
)
from rallypoint.distributed._init import destroy_process_group, init_process_group
from rallypoint.distributed._mesh import ParallelGroups, get_parallel_groups, init_parallel_groups
from rallypoint.distributed._worker import ParallelWorker, parallel_worker

if TYPE_CHECKING:
    from rallypoint.distributed._collectives import all_gather, all_to_all, reduce_scatter

__all__ = [
    "DIM_NAMES",
    "AlreadyInitializedError",
    "BackendUnavailableError",
    "DistributedConfig",
    "DistributedError",
    "NotInitializedError",
    "ParallelGroups",
    "ParallelWorker",
    "all_gather",
    "all_to_all",
    "destroy_process_group",
    "get_parallel_groups",
    "init_parallel_groups",
    "init_process_group",
    "parallel_worker",
    "reduce_scatter",
]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    dict.fromkeys(("all_gather", "all_to_all", "reduce_scatter"), f"{__name__}._collectives"),
    public_home=True,
)
set_public_module(__name__, globals(), __all__)
