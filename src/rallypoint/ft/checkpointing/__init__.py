"""``rallypoint.ft.checkpointing``: how a healing replica group gets a live group's state.

torchft's module: ``CheckpointTransport`` (the interface; a user's own transport works),
``HTTPTransport`` and, at torchft's path, ``pg_transport.PGTransport``. ``Manager`` heals
over the transport its ``checkpoint_transport=`` names; without one, over rallypoint's own
authenticated stream (itself a ``CheckpointTransport``). Nothing received from a peer is
unpickled. Usage and the trust model of each: docs/ft.md, "Transports".
"""

from rallypoint._core.public import set_public_module
from rallypoint.ft.checkpointing.http_transport import HTTPTransport as HTTPTransport
from rallypoint.ft.checkpointing.transport import CheckpointTransport as CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]

set_public_module(__name__, globals(), __all__)  # names of public modules keep theirs
del set_public_module
