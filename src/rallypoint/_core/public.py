"""Public names report their public module (``RendezvousError.__module__`` is
``"rallypoint.rendezvous"``, not the private module that defines it), as trio does.

Tracebacks, ``repr`` and pickles then name the module users import from; pickling still
works because the package re-exports every name it claims.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["set_public_module"]


def set_public_module(package: str, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Set ``__module__`` to ``package`` on every class and function among ``names``.

    Only objects defined in a private module of rallypoint are touched (``pkg._mod`` or an
    internal package, ``rallypoint._snapshot._api``): a name that ``package`` re-exports
    from another public module, or from torch, keeps its module.
    """
    root = package.partition(".")[0]
    for name in names:
        obj = namespace.get(name)
        if not isinstance(obj, type | types.FunctionType) and not hasattr(obj, "__wrapped__"):
            continue  # a decorated function (functools.cache) keeps its own __module__
        home = obj.__module__.split(".")
        if home[0] == root and any(part.startswith("_") for part in home[1:]):
            obj.__module__ = package
