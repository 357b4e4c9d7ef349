"""Public names report their public module (``RendezvousError.__module__`` is
``"rallypoint.rendezvous"``, not the private module that defines it), as trio does.

Tracebacks, ``repr`` and pickles then name the module users import from; pickling still
works because the package re-exports every name it claims. A face whose import must stay
cheap (``rallypoint.launcher``) gets its PEP 562 ``__getattr__`` and its ``__dir__`` from
:func:`lazy_names` and :func:`listing`, the one copy of that code.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_names", "listing", "set_public_module"]


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


def lazy_names(
    package: str,
    namespace: dict[str, Any],
    homes: Mapping[str, str],
    parts: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> Callable[[str], object]:
    """A lazy face's PEP 562 ``__getattr__``: each of ``homes`` imported from its module on
    first access (its ``__module__`` then set to ``package``, as :func:`set_public_module`
    does), each of ``parts`` a subpackage or submodule imported on first access, and each
    old name in ``renamed`` resolved to its new one with a ``DeprecationWarning``.

    The face assigns it under ``if not TYPE_CHECKING:`` (mypy reads the face's imports, so
    that a name not there stays an error)."""
    old_names = dict(renamed or {})

    def __getattr__(name: str) -> object:
        if name in old_names:
            new = old_names[name]
            warnings.warn(
                f"{package}.{name} is deprecated: it is {new}; the name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            name = new
            if name in namespace:
                return namespace[name]
        if name in parts:
            return import_module(f"{package}.{name}")  # which sets the attribute
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = getattr(import_module(homes[name]), name)
        set_public_module(package, namespace, [name])  # the one place: __module__ is the face
        return namespace[name]

    return __getattr__


def listing(namespace: Mapping[str, Any], names: Iterable[str]) -> Callable[[], list[str]]:
    """A face's ``__dir__``: its public ``names`` and its dunders, nothing else."""
    public = list(names)

    def __dir__() -> list[str]:
        return sorted([*public, *(name for name in namespace if name.startswith("__"))])

    return __dir__
