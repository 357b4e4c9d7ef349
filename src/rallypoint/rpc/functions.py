"""``rallypoint.rpc.functions``: the ``async_execution`` decorator (torch's contract).

A function decorated with :func:`async_execution` returns a ``torch.futures.Future``;
the callee replies when that future completes instead of when the function returns.
The marker attribute is the one torch uses, so a decorated function works with both the
rallypoint backend and the TENSORPIPE backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

_F = TypeVar("_F", bound=Callable[..., Any])

ASYNC_MARKER = "_wrapped_async_rpc_function"


def async_execution(fn: _F) -> _F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` that the RPC reply waits for.

    Combine with ``@staticmethod``/``@classmethod`` as the inner decorator, as in torch.
    """
    if not callable(fn):
        raise TypeError(f"async_execution expects a callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_MARKER, fn)
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: object) -> bool:
    """Whether ``fn`` was decorated with :func:`async_execution`."""
    return hasattr(fn, ASYNC_MARKER)


def no_future_error(fn: object, returned: object) -> RuntimeError:
    """The error of an :func:`async_execution` function that returned no future: torch's
    type and words, naming the function too."""
    return RuntimeError(
        "Functions decorated with @rpc.async_function must return a torch.futures.Future "
        f"object, but got {type(returned).__name__} from {getattr(fn, '__qualname__', fn)}"
    )
