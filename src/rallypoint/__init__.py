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
resolved lazily on first access (see ``rallypoint._core.face``).
"""

from typing import TYPE_CHECKING

from rallypoint._core.face import face

__version__ = "0.1.0"

if TYPE_CHECKING:
    from rallypoint import distributed as distributed
    from rallypoint import join as join
    from rallypoint import launcher as launcher
    from rallypoint import observe as observe
    from rallypoint import rendezvous as rendezvous
    from rallypoint import rpc as rpc
    from rallypoint import snapshot as snapshot
    from rallypoint import testing as testing
    from rallypoint.launcher import FatalError as FatalError
    from rallypoint.launcher import LaunchConfig as LaunchConfig
    from rallypoint.launcher import LaunchError as LaunchError
    from rallypoint.launcher import WorkerFailedError as WorkerFailedError
    from rallypoint.launcher import launch as launch
    from rallypoint.launcher import restartable as restartable
    from rallypoint.observe import progress as progress

__all__ = face(globals())
