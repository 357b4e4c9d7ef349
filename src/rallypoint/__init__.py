"""rallypoint: launch, rendezvous and coordinate the worker processes of PyTorch jobs.

The parts live in subpackages, each with its own public surface:

- ``rallypoint.launch`` / ``rallypoint run``: start workers fast, single- and multi-node
  (``rallypoint.launcher``)
- ``rallypoint.observe``: ``rallypoint.progress()`` heartbeats for hang detection, the
  event log and its timeline report
- ``rallypoint.rendezvous``: who is in the job (torchelastic's handler API)
- ``rallypoint.distributed``: process groups and parallel layouts
- ``rallypoint.rpc``: torch.distributed.rpc's API on an authenticated transport
- ``rallypoint.join``: uneven inputs
- ``rallypoint.snapshot``: in-memory snapshots of the training state, kept by the node and
  replicated to a peer, for restarts that lose no work
- ``rallypoint.testing``: fakes, fault injection and contract suites

Importing ``rallypoint`` does no work and does not import torch: the launcher must start
before torch is loaded so that the warm process can import it in parallel. Names are
resolved lazily on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY_NAMES: dict[str, str] = {
    "FatalError": "rallypoint.launcher",
    "launch": "rallypoint.launcher",
    "LaunchConfig": "rallypoint.launcher",
    "LaunchError": "rallypoint.launcher",
    "WorkerFailedError": "rallypoint.launcher",
    "progress": "rallypoint.observe",
    "restartable": "rallypoint.launcher",
}
_SUBPACKAGES = frozenset(
    {"distributed", "join", "launcher", "observe", "rendezvous", "rpc", "snapshot", "testing"}
)

__all__ = [
    "FatalError",
    "LaunchConfig",
    "LaunchError",
    "WorkerFailedError",
    "__version__",
    "distributed",
    "join",
    "launch",
    "launcher",
    "observe",
    "progress",
    "rendezvous",
    "restartable",
    "rpc",
    "snapshot",
    "testing",
]

if TYPE_CHECKING:
    from rallypoint import (
        distributed,
        join,
        launcher,
        observe,
        rendezvous,
        rpc,
        snapshot,
        testing,
    )
    from rallypoint.launcher import (
        FatalError,
        LaunchConfig,
        LaunchError,
        WorkerFailedError,
        launch,
        restartable,
    )
    from rallypoint.observe import progress


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_NAMES, submodules=_SUBPACKAGES)
