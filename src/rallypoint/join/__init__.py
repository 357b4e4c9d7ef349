"""Uneven inputs across ranks: torch's ``Join``/``Joinable``/``JoinHook``, failure-safe.

``from rallypoint.join import Join`` is a drop-in for
``from torch.distributed.algorithms.join import Join``: torch's
``DistributedDataParallel`` and ``ZeroRedundancyOptimizer`` work inside it unchanged. On
top of torch's semantics: a rank that raises inside the context makes the others raise
:class:`RankFailedError` within a second instead of hanging, a skew :class:`JoinSummary`,
``Join.iterate`` (join mode only for the last, uneven iterations),
``notify_join_context`` returning a future, :class:`CollectiveJoinable` for a loop's own
collectives, and :func:`even_batches` for users who prefer padding to joining.
"""

from rallypoint._core.public import set_public_module
from rallypoint.join._collective import CollectiveJoinable as CollectiveJoinable
from rallypoint.join._errors import EarlyTerminationError as EarlyTerminationError
from rallypoint.join._errors import JoinError as JoinError
from rallypoint.join._errors import RankFailedError as RankFailedError
from rallypoint.join._even_batches import EvenBatches as EvenBatches
from rallypoint.join._even_batches import even_batches as even_batches
from rallypoint.join._interface import Joinable as Joinable
from rallypoint.join._interface import JoinHook as JoinHook
from rallypoint.join._interface import SupportsJoin as SupportsJoin
from rallypoint.join._join import Join as Join
from rallypoint.join._join import JoinSummary as JoinSummary
from rallypoint.join._options import JoinOptions as JoinOptions

__all__ = [
    "CollectiveJoinable",
    "EarlyTerminationError",
    "EvenBatches",
    "Join",
    "JoinError",
    "JoinHook",
    "JoinOptions",
    "JoinSummary",
    "Joinable",
    "RankFailedError",
    "SupportsJoin",
    "even_batches",
]

set_public_module(__name__, globals(), __all__)  # the one place: __module__ is this face
del set_public_module
