"""Public names report their public module (``RendezvousError.__module__`` is
``"rallypoint.rendezvous"``, not the private module that defines it), as trio does.

Tracebacks, ``repr`` and pickles then name the module users import from; pickling still
works because the package re-exports every name it claims. A face whose import must stay
cheap (``rallypoint.launcher``) becomes a :class:`LazyFace` (:func:`lazy_face`), whose class
holds the one ``__getattr__`` and ``__dir__`` of every such face.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["LazyFace", "lazy_face", "set_public_module"]


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


class LazyFace(types.ModuleType):
    """The class of a lazy face (:func:`lazy_face`): the one ``__getattr__`` and ``__dir__``
    of every face whose import must stay cheap. A face keeps its names for mypy in
    ``if TYPE_CHECKING:`` and here reads its own tables: ``_HOMES`` (each name's module,
    imported on first access, its ``__module__`` then set to the face, as
    :func:`set_public_module` does), ``_PARTS`` (subpackages or submodules imported on
    first access) and ``_RENAMED`` (an old name resolved to its new one with a
    ``DeprecationWarning``)."""

    def __getattr__(self, name: str) -> object:
        package, namespace = self.__name__, self.__dict__
        renamed: Mapping[str, str] = namespace.get("_RENAMED", {})
        if name in renamed:
            new = renamed[name]
            warnings.warn(
                f"{package}.{name} is deprecated: it is {new}; the name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            name = new
            if name in namespace:
                return namespace[name]
        if name in namespace.get("_PARTS", ()):
            return import_module(f"{package}.{name}")  # which sets the attribute
        homes: Mapping[str, str] = namespace.get("_HOMES", {})
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = getattr(import_module(homes[name]), name)
        set_public_module(package, namespace, [name])  # the one place: __module__ is the face
        return namespace[name]

    def __dir__(self) -> list[str]:
        """Its public names and its dunders, nothing else."""
        names = self.__dict__
        return sorted([*names["__all__"], *(n for n in names if n.startswith("__"))])


def lazy_face(package: str) -> None:
    """Make the module ``package`` (a face, at the end of its import) a :class:`LazyFace`."""
    sys.modules[package].__class__ = LazyFace
