"""The type of a remote exception on the caller: its own, and torch's where they differ.

torch's ``rpc_sync``/``rpc_async`` raise a remote ``ValueError`` or ``TypeError`` as
that type, and every other remote exception as ``RuntimeError`` (its C++ future keeps
only those three kinds). rallypoint raises the remote exception's own type, so
``except KeyError`` works; for types that are not already a ``RuntimeError``,
``ValueError`` or ``TypeError`` it raises a subclass of that type and ``RuntimeError``,
so code written against torch's ``except RuntimeError`` keeps working too. The subclass
carries the original's name and pickles as the original type.
"""

from __future__ import annotations

import threading

_TORCH_KEEPS = (RuntimeError, ValueError, TypeError)
_cache: dict[type[BaseException], type[BaseException]] = {}
_lock = threading.Lock()


def _reduce(exc: BaseException) -> tuple[object, ...]:
    original = type(exc).__mro__[1]
    return (original, exc.args)


def catchable_as_torch(kind: type[BaseException]) -> type[BaseException]:
    """``kind``, or a subclass of ``kind`` and ``RuntimeError`` when torch raises a
    ``RuntimeError`` for it (``kind`` itself where the two cannot be combined)."""
    if issubclass(kind, _TORCH_KEEPS) or not issubclass(kind, Exception):
        return kind
    with _lock:
        combined = _cache.get(kind)
        if combined is None:
            try:
                combined = type(
                    kind.__name__,
                    (kind, RuntimeError),
                    {
                        "__module__": kind.__module__,
                        "__qualname__": kind.__qualname__,
                        "__reduce__": _reduce,
                    },
                )
            except TypeError:  # an incompatible layout: keep the remote type alone
                combined = kind
            _cache[kind] = combined
    return combined
