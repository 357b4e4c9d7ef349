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

from typing import TYPE_CHECKING

from rallypoint._core.public import lazy_face

if TYPE_CHECKING:
    from rallypoint.distributed._collectives import all_gather as all_gather
    from rallypoint.distributed._collectives import all_to_all as all_to_all
    from rallypoint.distributed._collectives import reduce_scatter as reduce_scatter
    from rallypoint.distributed._config import DIM_NAMES as DIM_NAMES
    from rallypoint.distributed._config import DistributedConfig as DistributedConfig
    from rallypoint.distributed._errors import AlreadyInitializedError as AlreadyInitializedError
    from rallypoint.distributed._errors import BackendUnavailableError as BackendUnavailableError
    from rallypoint.distributed._errors import DistributedError as DistributedError
    from rallypoint.distributed._errors import NotInitializedError as NotInitializedError
    from rallypoint.distributed._init import destroy_process_group as destroy_process_group
    from rallypoint.distributed._init import init_process_group as init_process_group
    from rallypoint.distributed._mesh import ParallelGroups as ParallelGroups
    from rallypoint.distributed._mesh import get_parallel_groups as get_parallel_groups
    from rallypoint.distributed._mesh import init_parallel_groups as init_parallel_groups
    from rallypoint.distributed._worker import ParallelWorker as ParallelWorker
    from rallypoint.distributed._worker import parallel_worker as parallel_worker

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

_HOMES = {
    "AlreadyInitializedError": "rallypoint.distributed._errors",
    "BackendUnavailableError": "rallypoint.distributed._errors",
    "DIM_NAMES": "rallypoint.distributed._config",
    "DistributedConfig": "rallypoint.distributed._config",
    "DistributedError": "rallypoint.distributed._errors",
    "NotInitializedError": "rallypoint.distributed._errors",
    "ParallelGroups": "rallypoint.distributed._mesh",
    "ParallelWorker": "rallypoint.distributed._worker",
    "all_gather": "rallypoint.distributed._collectives",
    "all_to_all": "rallypoint.distributed._collectives",
    "destroy_process_group": "rallypoint.distributed._init",
    "get_parallel_groups": "rallypoint.distributed._mesh",
    "init_parallel_groups": "rallypoint.distributed._mesh",
    "init_process_group": "rallypoint.distributed._init",
    "parallel_worker": "rallypoint.distributed._worker",
    "reduce_scatter": "rallypoint.distributed._collectives",
}
"""Each name's module, imported on first access (PEP 562)."""

lazy_face(__name__)  # its __getattr__ and __dir__ read _HOMES (mypy reads the imports above)
del lazy_face
