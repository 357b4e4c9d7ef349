"""Lazy public attributes for a package ``__init__``: a submodule is imported on first use.

A package that must stay cheap to import (``rallypoint``, ``rallypoint.testing``) names
its public attributes and the modules that define them; :func:`lazy_attributes` builds the
module-level ``__getattr__`` and ``__dir__`` (PEP 562) from that map::

    __getattr__, __dir__ = lazy_attributes(__name__, globals(), {"run_workers": "pkg._workers"})

A public package may also offer its sibling packages a few ``internal`` names (the
launcher side's machinery): those resolve the same way but are not listed by ``dir()``,
so the package's public surface stays what its ``__all__`` says.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

from rallypoint._core.public import set_public_module

__all__ = ["homes", "lazy_attributes"]


def homes(package: str, modules: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """``{name: "package.module"}`` from a face's table ``{module: names}``."""
    return {name: f"{package}.{module}" for module, names in modules.items() for name in names}


def lazy_attributes(
    package: str,
    namespace: MutableMapping[str, Any],
    names: Mapping[str, str],
    *,
    submodules: Iterable[str] = (),
    public_home: bool = False,
    internal: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose globals are ``namespace``.

    ``names`` maps an attribute to the module that defines it; ``submodules`` are child
    modules imported when accessed as attributes (``rallypoint.rpc``). A resolved attribute
    is stored in ``namespace``, so each is imported once. With ``public_home`` the package
    is where its names are documented: a class or function that is resolved reports
    ``package`` as its ``__module__`` (see :func:`~rallypoint._core.public.set_public_module`).
    ``internal`` maps names for rallypoint's other packages only: resolved like ``names``,
    but left out of ``dir()`` and never given ``package`` as their ``__module__``.
    """
    table = dict(names)
    hidden = dict(internal or {})
    children = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        module = table.get(name) or hidden.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            if name in hidden:  # not cached: dir() lists the namespace
                return value
            namespace[name] = value
            if public_home:
                set_public_module(package, namespace, [name])
            return value
        if name in children:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())) | set(table))

    return __getattr__, __dir__
