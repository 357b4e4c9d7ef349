"""rallypoint: launch, rendezvous and coordinate the worker processes of PyTorch jobs.

Each part is a subpackage with its own public names (listed below); the most used are
also here. Importing ``rallypoint`` does not import torch (the launcher starts before
torch loads, so that its warm process imports torch in parallel): names resolve on first
access (``rallypoint._core.face``).
"""

from typing import TYPE_CHECKING

from rallypoint._core.face import face
from rallypoint._core.version import __version__ as __version__

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
    from rallypoint.launcher import RestartInterrupt as RestartInterrupt
    from rallypoint.launcher import WorkerFailedError as WorkerFailedError
    from rallypoint.launcher import launch as launch
    from rallypoint.launcher import restartable as restartable
    from rallypoint.observe import progress as progress

__all__ = face(globals())
