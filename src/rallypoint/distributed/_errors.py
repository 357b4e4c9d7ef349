"""Exceptions of ``rallypoint.distributed``.

Bad arguments raise ``ValueError``/``TypeError`` with a message that says what to change.
Everything else derives from one root::

    DistributedError (RuntimeError)
    ├── AlreadyInitializedError   init_process_group called again with other settings
    ├── NotInitializedError       parallel groups asked for before init_parallel_groups
    └── BackendUnavailableError   e.g. "nccl" on a machine without CUDA

Errors that torch raises from inside a collective are not wrapped: they are torch's.
"""

from __future__ import annotations


class DistributedError(RuntimeError):
    """Root of the errors raised by ``rallypoint.distributed``."""


class AlreadyInitializedError(DistributedError):
    """The default process group exists and was created with different settings."""


class NotInitializedError(DistributedError):
    """An accessor needs state (parallel groups) that has not been created yet."""


class BackendUnavailableError(DistributedError):
    """The requested communication backend cannot run on this machine or torch build."""
