"""The heal stream's names where the ft tests import them: :mod:`rallypoint.ft._state.heal`
(the stream) and :mod:`rallypoint.ft._state.encoding` (the state's typed encoding)."""

from rallypoint.ft._state.encoding import HealError, decode_skeleton, encode_skeleton
from rallypoint.ft._state.heal import (
    MAX_CONNECTIONS,
    HealServer,
    IncompatibleStateError,
    fetch_state,
    mismatch,
)

__all__ = [
    "MAX_CONNECTIONS",
    "HealError",
    "HealServer",
    "IncompatibleStateError",
    "decode_skeleton",
    "encode_skeleton",
    "fetch_state",
    "mismatch",
]
